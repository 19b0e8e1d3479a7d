"""The ground floor: what every layer needs and nothing of the project's own. errors (the exceptions a user can
cause, printed as one `error:` line), network (the hub and wandb asked only when they answer, never a prompt), early
(Ctrl-C while the libraries load)."""
