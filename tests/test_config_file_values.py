"""Issue 29, item 7: every value of a config file is validated, also those a flag overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from ndtrain.config import load_config
from ndtrain.errors import UserError
from tests.helpers.runs import ndtrain, one_error_line


def test_a_wrong_value_in_a_file_is_refused_although_a_flag_overrides_it(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('[schedule]\nsteps = "ten"\n')
    with pytest.raises(UserError, match=rf"config file '{config}': config key 'schedule.steps' must be int, got 'ten'"):
        load_config(config, {"schedule.steps": 5})
    line = one_error_line(ndtrain("train", str(config), "--steps", "5", "--model", "tiny", "--check",
                                  "--out", str(tmp_path / "run")))
    assert "run.toml': config key 'schedule.steps' must be int" in line
    assert not (tmp_path / "run").exists()


def test_a_good_file_is_still_overridden_by_flags(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('[schedule]\nsteps = 10\n[model]\npreset = "tiny"\n')
    assert load_config(config, {"schedule.steps": 5}).schedule.steps == 5
