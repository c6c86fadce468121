"""The 2-process exit race (session 31): each of 2 spawned gloo processes makes the main job's imports, then its
Accelerator, then the job's last collective (Collective.agreement); process 0 then "writes its report" (0.3 s) and
both return, with or without Collective.settle. Counts the runs where a process did not exit 0 (SIGABRT: -6).

    python bench/probes/exit_race.py plain 50
    python bench/probes/exit_race.py settle 60
"""
import os
import socket
import sys
import time

import torch.multiprocessing as mp


def rank_main(rank: int, port: int, variant: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import importlib

    import torch

    importlib.import_module("drafttrain.rl.job")  # the main job's imports come before its group, as in online.py
    from drafttrain.tracking.collective import Collective
    from drafttrain.tracking.trainer import make_accelerator

    acc = make_accelerator()
    torch.manual_seed(0)
    assert Collective(acc).agreement(5, torch.nn.Linear(8, 8))["agree"]
    if rank == 0:
        time.sleep(0.3)  # the main process writes its report
    if variant == "settle":
        Collective(acc).settle()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    variant, n = sys.argv[1], int(sys.argv[2])
    ctx, fails = mp.get_context("spawn"), 0
    for i in range(n):
        port = free_port()
        procs = [ctx.Process(target=rank_main, args=(r, port, variant)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        codes = [p.exitcode for p in procs]
        if codes != [0, 0]:
            fails += 1
            print(f"run {i}: exit codes {codes}", flush=True)
    print(f"{variant}: {fails} of {n} runs with a process not exiting 0")
