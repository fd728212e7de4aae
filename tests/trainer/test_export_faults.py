"""Issue 25 item 5: a full disk while the run writes its Hugging Face export is one error
line, after summary.json is written; no half-written export is left, and resume=true
writes the export afterwards."""

from __future__ import annotations

import errno
import json

import pytest

from nemo_d3s.train import run_cli

from .conftest import FAST, compose


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def _safetensors_enospc(*a, **k):  # what the safetensors library raises when the disk fills
    from safetensors import SafetensorError

    raise SafetensorError(
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
        'left on device" })'
    )


@pytest.mark.parametrize(
    "failure", [_enospc, _safetensors_enospc], ids=["oserror", "safetensors_error"]
)
def test_disk_full_while_exporting_is_an_error_line_after_the_summary(
    tmp_path, capsys, monkeypatch, failure
):
    import safetensors.torch

    run_dir = tmp_path / "run"
    overrides = ["experiment=smoke", f"output_dir={run_dir}", *FAST, "trainer.export_hf=true"]
    real = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", failure)
    code = run_cli(compose(overrides))
    stderr = capsys.readouterr().err
    err = stderr.strip().splitlines()[-1]  # (transformers may warn on stderr before it)
    assert code == 2 and "Traceback" not in stderr and stderr.count("error:") == 1, stderr
    assert (
        err.startswith("error: could not write the Hugging Face export")
        and str(run_dir / "hf_export") in err
    )
    assert "No space left on device" in err and "MiB free there" in err and "resume=true" in err
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    assert not (run_dir / "hf_export").exists()
    assert not [
        p for p in run_dir.iterdir() if p.name.startswith(".hf_export")
    ]  # no staging folder, no lock
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert run_cli(compose([*overrides, "resume=true"])) == 0  # what the message says to do
    assert (run_dir / "hf_export" / "model.safetensors").is_file()
