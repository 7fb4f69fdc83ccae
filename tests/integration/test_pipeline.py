"""Pipeline-parallel training trains as one process does on the same batches.

Real processes; the script is tests/integration/scripts/pipeline_train.py (an MLP of ReLU blocks cut
into stages, SGD, seeded batches). After 10 steps every stage's parameters are within 1e-6 of the
single-process model's, for GPipe, 1F1B, interleaved 1F1B (two chunks per worker, the stages in a
ring) and zero bubble (ZB-H1, and interleaved: the backward split into I and W), with and without ZVC
and offload, and with several replicas of the pipeline (pipeline + data parallel). Jobs the launcher
matters to (a failing stage, the example, the GPU) run under `sluice launch`; the others run the
script's `train` in workers forked from this process (testbed/cluster.py), which start in a fraction of
the time a fresh Python importing torch takes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sluice.launch.config import SluiceConfig
from sluice.worker.pipeline.schedule import peak_activations, schedule
from testbed.cluster import LocalCluster
from tests.integration import prefork, preloads
from tests.integration.pipeline_helpers import SCRIPT, check_matches, job, reference, reference_model

ROOT = Path(__file__).resolve().parents[2]
prefork.torch_optimizers()  # once here, not in every forked worker
LAUNCH = [sys.executable, "-m", "sluice.launch.cli", "launch", *preloads.TORCH, "-s", "0"]


def run(workers: int, *args: str, settings: tuple[str, ...] = (), fails: bool = False,
        timeout: float = 120) -> tuple[str, list[dict[str, Any]]]:
    done = subprocess.run([*LAUNCH, "-w", str(workers), *settings, "--", sys.executable, str(SCRIPT), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    if fails:
        assert done.returncode != 0, output[-6000:]
        return output, []
    assert done.returncode == 0, output[-6000:]
    results = [json.loads(m.group(1)) for m in re.finditer(r"PIPELINE_RESULT (.*)$", done.stdout, re.M)]
    assert len(results) == workers, output[-4000:]
    return output, sorted(results, key=lambda r: r["rank"])


def _stage(argv: list[str]) -> dict[str, Any]:
    """A forked worker: the script's training, then its result as the script prints it (JSON)."""
    result = job.train(argv)
    job.hvd.shutdown()
    return json.loads(json.dumps(result))


def forked(workers: int, *args: str, config: dict[str, Any] | None = None,
           timeout: float = 90) -> list[dict[str, Any]]:
    """The script in `workers` forked workers of a LocalCluster without servers (as `sluice launch -s 0`), with
    every section of the config, defaults filled in, as the launcher hands it over."""
    with LocalCluster(workers, 0, SluiceConfig.from_sections(config or {}).to_sections()) as cluster:
        results = cluster.run(_stage, list(args), timeout=timeout)
        assert cluster.wait() == [0] * (1 + workers)
    assert len(results) == workers
    return sorted(results, key=lambda r: r["rank"])


CASES = [  # (stages, replicas, micro-batches, schedule, compress, offload, direct lanes, chunks per stage)
    (2, 1, 4, "1f1b", "on", False, True, 1),
    (2, 1, 4, "gpipe", "off", True, True, 1),
    (4, 1, 8, "1f1b", "on", True, True, 1),
    (3, 1, 4, "gpipe", "on", False, False, 1),
    (2, 2, 4, "1f1b", "on", False, True, 1),
    (2, 2, 2, "gpipe", "off", True, False, 1),
    (2, 1, 4, "interleaved1f1b", "on", False, True, 2),
    (3, 1, 4, "interleaved1f1b", "off", False, True, 2),  # a ring of three: each stage offers the next a lane
    (2, 1, 4, "interleavedzerobubble", "on", False, True, 1),  # ZB-H1
    (4, 1, 8, "interleavedzerobubble", "off", False, True, 1),
    (2, 2, 4, "interleavedzerobubble", "on", False, True, 2),
    (2, 1, 2, "interleaved1f1b", "off", False, False, 2),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("stages", "replicas", "micro", "kind", "compress", "offload", "direct", "virtual"), CASES,
                         ids=[f"P{c[0]}xR{c[1]}-M{c[2]}-{c[3]}-zvc_{c[4]}{'-offload' if c[5] else ''}"
                              f"{'' if c[6] else '-transport'}{f'-V{c[7]}' if c[7] > 1 else ''}" for c in CASES])
def test_pipeline_matches_one_process(stages: int, replicas: int, micro: int, kind: str, compress: str,
                                      offload: bool, direct: bool, virtual: int) -> None:
    batch = 16
    results = forked(stages * replicas, "--stages", str(stages), "--micro", str(micro), "--schedule", kind,
                     "--compress", compress, "--batch", str(batch), "--steps", "10", "--virtual", str(virtual),
                     *(["--offload"] if offload else []), *([] if direct else ["--no-direct"]))
    assert all(r["lanes"] == direct for r in results)  # every neighbour is on this host
    check_matches(results, stages, reference(10, batch * replicas))
    orders = schedule(kind, stages, micro, virtual)
    for r in results:  # each stage held as many micro-batches' activations as its schedule needs, no more
        assert set(r["peaks"]) == {peak_activations(orders[r["stage"]])}
        if compress == "on" and r["stage"] < stages - 1 and virtual == 1:
            assert r["ratio"]["forward"] > 1.2, r["ratio"]  # ReLU outputs: about half zeros
        if compress == "off":
            assert r["ratio"] == {"forward": 1.0, "backward": 1.0}
        assert bool(r["offloaded"]) == offload
    # a stage's received inputs are held for its backward anyway; what its layers save inside is offloaded
    # (on this CPU, kept as it is and counted), a ReLU's output shared with the Linear after it, or a ReLU's
    # bitmask (lean saves: a ReLU that ends a stage keeps only that)
    assert (sum(n for r in results for n in r["offloaded"]) > 0) == offload
    assert (sum(n for r in results for n in r["lean"]) > 0) == offload
    last = [r for r in results if r["stage"] == stages - 1]
    assert all(len(r["losses"]) == 10 for r in last)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_inputs_gradient_first_trains_bit_for_bit_as_whole_backwards_and_is_chosen_by_measuring(kind: str) -> None:
    """Three stages: every backward split (the inputs' gradient sent before the weights' are computed), or
    none, gives the same parameters to the last bit; left to measure (the default), each stage with one
    before it runs its trial steps (after three cold ones: runs of each way, all but the first of a run
    timed), then keeps one way; the first stage has nothing to split."""
    args = ["--stages", "3", "--micro", "4", "--schedule", kind, "--steps", "16", "--compress", "off"]
    split, whole, measured = (forked(3, *args, "--inputs-first", mode) for mode in ("on", "off", "auto"))
    assert [r["params"] for r in split] == [r["params"] for r in whole]
    check_matches(measured, 3, reference(16, 16))
    assert [r["early"] for r in split] == [None, [None, 0, 0], [None, 0, 0]]
    assert [r["early"] for r in whole] == [None, None, None]
    assert measured[0]["early"] is None
    for r in measured[1:]:
        chosen, wholes, splits = r["early"]
        assert chosen in (True, False) and [wholes, splits] == [4, 5], r["early"]


@pytest.mark.timeout(120)
def test_a_backward_that_cannot_be_split_runs_whole_and_the_stage_stops_trying() -> None:
    """Reentrant checkpointing refuses torch.autograd.grad: a stage whose split trial meets it runs that
    backward whole (the same gradients) and never splits again; the job trains as one process does."""
    results = forked(3, "--stages", "3", "--micro", "4", "--schedule", "1f1b", "--steps", "16", "--compress", "off",
                     "--checkpoint")
    check_matches(results, 3, reference(16, 16))
    assert [r["unsplittable"] for r in results] == [False, True, True]
    assert [r["early"] for r in results[1:]] == [[None, 2, 0]] * 2  # two whole trial steps timed, then the refusal
    output, _ = run(3, "--stages", "3", "--micro", "4", "--schedule", "interleavedzerobubble", "--steps", "2",
                    "--checkpoint", fails=True)  # zero bubble cannot run whole: it says why, and what to do
    assert "zero bubble splits each backward in two, which autograd refused here" in output, output[-4000:]
    assert "use_reentrant=False" in output


@pytest.mark.timeout(120)
@pytest.mark.parametrize("options", [["--no-lean"], ["--offload-zvc"]])
def test_offload_with_zvc_matches_one_process(options: list[str]) -> None:
    """ZVC on what is offloaded: the ReLUs' outputs themselves (`offload_lean=False`) or, with lean saves,
    what the Linear layers save (`offload_compress=True`), on every stage."""
    results = forked(2, "--stages", "2", "--micro", "2", "--schedule", "1f1b", "--compress", "off", "--offload",
                     *options, "--steps", "10")
    check_matches(results, 2, reference(10, 16))
    assert all(sum(r["offloaded"]) > 0 and max(r["offload_ratio"]) > 1.2 for r in results)
    assert all((sum(r["lean"]) == 0) == (options == ["--no-lean"]) for r in results)


@pytest.mark.timeout(180)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
def test_pipeline_on_cuda_with_offload_matches_one_process(kind: str) -> None:
    """Both stages on the one GPU, their activations offloaded to pinned host memory and fetched back ahead;
    against the CPU reference within 1e-5: the GPU's kernels sum in another order than the CPU's."""
    _, results = run(2, "--stages", "2", "--micro", "4", "--schedule", kind, "--compress", "on", "--offload",
                     "--device", "cuda", "--steps", "10")
    check_matches(results, 2, reference(10, 16), tolerance=1e-5)
    assert all(r["offloaded"] for r in results)


@pytest.mark.timeout(120)
def test_a_batch_shape_that_changes_between_steps_needs_nothing_agreed() -> None:
    results = forked(2, "--stages", "2", "--micro", "4", "--compress", "on", "--grow-at", "4", "--steps", "8")
    check_matches(results, 2, reference(8, 16, grow_at=4))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("compress", ["on", "off"])
def test_activations_larger_than_a_chunk_travel_in_pieces(compress: str) -> None:
    """2 MiB activations per micro-batch (8192 samples x 64), twice the job's 1 MiB chunk: a data socket
    refuses a larger frame, so each tensor goes in pieces."""
    results = forked(2, "--stages", "2", "--micro", "1", "--width", "64", "--batch", "8192", "--steps", "3",
                     "--compress", compress)
    check_matches(results, 2, reference(3, 8192, width=64))


@pytest.mark.timeout(120)
def test_a_stage_that_cannot_take_its_inputs_fails_the_job_naming_itself() -> None:
    started = time.monotonic()
    output, _ = run(2, "--stages", "2", "--bad-stage", "1", fails=True)
    assert time.monotonic() - started < 60
    assert ("SluiceError: stage 1 (worker 1 on localhost): its module failed on micro-batch 0 of step 0, whose inputs "
            "were [4, 32] torch.float32: RuntimeError: mat1 and mat2 shapes cannot be multiplied") in output
    # named first whichever exit the launcher sees first: stage 0, which then fails waiting for it, names it too
    stopped = re.search(r"sluice launch: worker 1 \(pid \d+\) exited with code 1(; worker 0 \(pid \d+\) reported: "
                        r"stage 0 \(worker 0 on localhost\) waited for the gradients [^\n]*)?; stopping the job",
                        output)
    assert stopped, output[-3000:]


@pytest.mark.timeout(120)
def test_a_stalled_stage_is_named_by_its_neighbour_at_the_deadline() -> None:
    started = time.monotonic()
    config = SluiceConfig.from_sections({"scheduler": {"op_timeout": 2}}).to_sections()
    with LocalCluster(3, 0, config) as cluster:  # stage 2 stalls: closing kills it
        reports = cluster.start_workers(_stage, ["--stages", "3", "--stall-stage", "2", "--stall-at", "2"])
        failed: dict[int, tuple[str, Any]] = {}
        while 1 not in failed:  # the neighbour's report; the job fails (a worker's error)
            failed.update(cluster.collect(reports, 1, timeout=max(0.1, started + 60 - time.monotonic())))
    assert time.monotonic() - started < 60
    assert all(status == "error" for status, _ in failed.values()), failed
    output = "\n".join(str(value) for _, value in failed.values())
    assert ("SluiceError: stage 1 (worker 1 on localhost) waited for the gradients of micro-batch 0 of step 2 from "
            "stage 2 (worker 2 on localhost): not complete after 2 s (nothing came, over a direct lane); "
            "stage 2 (worker 2 on localhost) is slow, stuck or gone") in output, output[-3000:]


@pytest.mark.timeout(120)
def test_eval_steps_give_the_models_outputs_and_keep_the_stages_in_step() -> None:
    """Forward-only steps, many in a row (the first stage waits for no gradient in them), then the outputs
    equal the single-process model's on the same inputs."""
    results = forked(6, "--stages", "3", "--micro", "2", "--steps", "3", "--eval-steps", "12", "--batch", "8")
    model = reference_model(3, 16)
    for r in results:
        if r["stage"] != 2:
            continue
        assert len(r["evaluated"]) == 12
        for step, got in enumerate(r["evaluated"]):
            x, _ = job.batch(3 + step, 16)
            want = model(x[r["replica"] * 8:(r["replica"] + 1) * 8]).detach().reshape(-1).numpy()
            assert float(np.abs(np.asarray(got, np.float32) - want).max()) <= 1e-6


@pytest.mark.timeout(120)
def test_eval_steps_go_round_a_ring_of_chunks() -> None:
    """Interleaved (two chunks per worker): eval runs chunk 0's forwards, then chunk 1's, round the ring."""
    results = forked(2, "--stages", "2", "--micro", "2", "--steps", "2", "--eval-steps", "3", "--batch", "8",
                     "--schedule", "interleaved1f1b", "--virtual", "2")
    model = reference_model(2, 8)
    evaluated = next(r["evaluated"] for r in results if r["stage"] == 1)
    assert len(evaluated) == 3
    for step, got in enumerate(evaluated):
        want = model(job.batch(2 + step, 8)[0]).detach().reshape(-1).numpy()
        assert float(np.abs(np.asarray(got, np.float32) - want).max()) <= 1e-6


@pytest.mark.timeout(120)
def test_the_example_trains_digits_with_two_replicas_of_two_stages() -> None:
    done = subprocess.run([*LAUNCH, "-w", "4", "--", sys.executable, str(ROOT / "examples/train_digits_pipeline.py"),
                           "--stages", "2", "--epochs", "4", "--target", "0.85", "--compress", "on"], cwd=ROOT,
                          capture_output=True, text=True, timeout=110)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert re.search(r"\[worker 1\] replica 0 epoch  4 .* test accuracy", output), output[-3000:]
    ratios = [float(m) for m in re.findall(r"stage 0 of replica \d: ZVC ratio ([0-9.]+) for the activations", output)]
    assert len(ratios) == 2 and min(ratios) > 1.1, output[-3000:]  # pooled ReLU outputs hold zeros
