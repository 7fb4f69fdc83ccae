"""The variables torchrun gives each worker, which scripts and libraries read; a worker of `sluice launch` gets each.

torch 2.13's local_elastic_agent sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the machine),
GROUP_WORLD_SIZE, ROLE_RANK, ROLE_NAME, ROLE_WORLD_SIZE, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS,
TORCHELASTIC_RUN_ID and TORCHELASTIC_USE_AGENT_STORE (MASTER_ADDR and MASTER_PORT come with the job's store).
Scripts read the restart count to resume from a checkpoint, and Lightning takes a process with
TORCHELASTIC_RUN_ID for one that torchrun started (its TorchElasticEnvironment, ranks from these variables).
The agent's store is not used here: rank 0 of torch.distributed hosts its own, as under a static rendezvous.
"""

from __future__ import annotations

#: torchrun's --rdzv-id when none is given
RUN_ID = "none"
#: torchrun's variables for the start a worker belongs to (launch/restarts.py)
ENV_RESTART_COUNT, ENV_MAX_RESTARTS = "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"


def torchrun_env(rank: int, world: int, local_rank: int, local_world: int, group_rank: int, groups: int,
                 restart: int = 0, max_restarts: int = 0) -> dict[str, str]:
    """A worker's torchrun variables: global `rank` of `world`, `local_rank` of `local_world` on machine
    `group_rank` of `groups`, in start `restart` of at most `max_restarts` + 1."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(group_rank), "GROUP_WORLD_SIZE": str(groups),
            "ROLE_RANK": str(rank), "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(world),
            ENV_RESTART_COUNT: str(restart), ENV_MAX_RESTARTS: str(max_restarts),
            "TORCHELASTIC_RUN_ID": RUN_ID, "TORCHELASTIC_USE_AGENT_STORE": "False"}
