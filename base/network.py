"""The network: the Hugging Face hub and the wandb server are asked for only when they answer within seconds, and
wandb never prompts for a login.

Imports nothing of the project, so model.py, task.py, flags.py and train.py can all ask it without a cycle.
"""

from __future__ import annotations

import os
import socket
import urllib.parse
from pathlib import Path


def reachable(url: str, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the URL's host opens within `timeout` seconds."""
    parts = urllib.parse.urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)),
                                 timeout=timeout).close()
        return True
    except OSError:
        return False


def hub_endpoint() -> str:
    """The hub address the Hugging Face client will use (HF_ENDPOINT, read when huggingface_hub is imported)."""
    from huggingface_hub import constants

    return constants.ENDPOINT


def hub_offline(timeout: float = 3.0) -> bool:
    """True when the hub is switched off (HF_HUB_OFFLINE) or does not answer within `timeout` seconds. Asked once,
    up front: the hub client's own retries take close to a minute to give up."""
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false") or not reachable(hub_endpoint(), timeout)


def wandb_has_login() -> bool:
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return bool(os.environ.get("WANDB_API_KEY")) or (netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"))


def wandb_mode(requested: str | None) -> str:
    """online only when credentials exist; never an interactive login prompt."""
    if requested:
        return requested
    if os.environ.get("WANDB_MODE") in ("online", "offline", "disabled"):
        return os.environ["WANDB_MODE"]
    return "online" if wandb_has_login() else "offline"


def wandb_init(**kwargs):
    """wandb.init that cannot hang or prompt: online falls back to offline, with one warning line, when the server
    does not answer within seconds or refuses the login. Disabled: None, and no wandb at all (not even imported:
    seconds at start-up)."""
    if kwargs["mode"] == "disabled":
        return None
    import wandb

    settings = wandb.Settings(console="off", silent=True, init_timeout=30)
    if kwargs["mode"] == "online":
        base = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
        if not reachable(base):
            print(f"warning: wandb server {base} did not answer within 3 s; logging offline instead (wandb sync later)")
            kwargs["mode"] = "offline"
        else:
            try:
                return wandb.init(settings=settings, **kwargs)
            except Exception as e:  # bad key, server error: the run matters more than the online dashboard
                print(f"warning: wandb online failed ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}); "
                      "logging offline instead")
                kwargs["mode"] = "offline"
    return wandb.init(settings=settings, **kwargs)
