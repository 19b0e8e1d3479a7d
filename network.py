"""The network: the Hugging Face hub and the wandb server are asked for only when they answer within seconds.

Imports nothing of the project, so model.py, task.py and guards.py can all ask it without a cycle.
"""

from __future__ import annotations

import os
import socket
import urllib.parse


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
