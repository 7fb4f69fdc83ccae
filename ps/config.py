"""Settings of the server role."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    #: True: a round completes when every worker pushed (synchronous SGD). False: tensors that carry
    #: an optimizer are updated as each push arrives and pulls return the latest value (asynchronous).
    sync: bool = True
