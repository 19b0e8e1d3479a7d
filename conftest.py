# Lets the tests import the top-level modules (train, losses, ...) when pytest runs from the repository root.
