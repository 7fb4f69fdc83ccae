"""examples/kubernetes: its README's commands are the renderer's, and the manifests there are what they print."""

from __future__ import annotations

import io
import re
import shlex
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import yaml

from sluice.launch import kubernetes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "kubernetes"
README = (EXAMPLES / "README.md").read_text()


def _shell_lines() -> list[str]:
    """The commands in the README's sh blocks, continuation lines joined."""
    lines: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip():
                lines.append(" ".join(line.split()))
    return lines


def _render(words: list[str]) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert kubernetes.main(words) == 0, shlex.join(words)
    return out.getvalue()


@pytest.mark.timeout(30)
def test_every_sluice_kubernetes_command_in_the_readme_runs_and_writes_what_is_committed() -> None:
    commands = [line for line in _shell_lines() if line.startswith("sluice kubernetes ")]
    assert len(commands) >= 3
    written = set()
    for line in commands:
        words = shlex.split(line, comments=True)
        target = words[words.index(">") + 1] if ">" in words else None
        words = words[: words.index(">")] if target else words
        text = _render(words[2:])
        # the README writes the command as the manifest's header does: so it is the renderer's own
        assert f"# Written by: {shlex.join(words)}\n" in text
        if target and target.startswith("examples/kubernetes/"):
            assert (ROOT / target).read_text() == text, f"regenerate it: {shlex.join(words)} > {target}"
            written.add(Path(target).name)
    assert written == {path.name for path in EXAMPLES.glob("*.yaml")}  # no manifest here that no command writes


@pytest.mark.timeout(30)
def test_the_readmes_kubectl_commands_fit_the_manifests() -> None:
    jobset = next(yaml.safe_load_all((EXAMPLES / "sluice-job.yaml").read_text()))
    templates = [r["template"]["spec"]["template"]["metadata"]["labels"] for r in jobset["spec"]["replicatedJobs"]]
    header = next(line for line in (EXAMPLES / "sluice-job.yaml").read_text().splitlines()
                  if line.startswith("# First make its secret: ")).removeprefix("# First make its secret: ")
    kubectl = re.compile(r"^kubectl (?:get pods|logs) .*?-l (\S+)")
    selectors = [found for line in _shell_lines() for found in kubectl.findall(line)]
    assert selectors and header in _shell_lines()
    for selector in selectors:
        ours = dict(item.split("=") for item in selector.split(",") if item.startswith("app.kubernetes.io/"))
        assert any(ours.items() <= labels.items() for labels in templates), selector
    assert f"kubectl wait --for=condition=Completed jobset/{jobset['metadata']['name']}" in README
