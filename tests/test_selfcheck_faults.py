"""Issue 32: the self-check's faults: every bad argument or surrounding is one error line
(exit 2), an interrupted or timed-out run still writes selfcheck.json with what finished,
and no scratch folder is left behind."""

from __future__ import annotations

import pytest

from nemo_d3s.selfcheck import cli


@pytest.mark.parametrize("only", ["nosuch", "env,nosuch", ",", ""])
def test_only_naming_no_check_is_refused(only, capsys):
    """It printed "0 passed" and exited 0: a clean bill for a machine nothing checked."""
    with pytest.raises(SystemExit) as e:
        cli.main(["--only", only])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "matches no check; the checks are env.versions" in err, err
