from pathlib import Path

import pytest

from hpcfed.config import ConfigError, build, from_mapping, load
from hpcfed.tasks.synthetic import SyntheticTask

REPO = Path(__file__).resolve().parents[2]


def test_quickstart_config_loads_with_overrides():
    cfg = load(REPO / "configs" / "quickstart.yaml", ["rounds=3", "task.lr=0.5", "federation.quorum=0.5"])
    assert cfg.rounds == 3 and cfg.federation.quorum == 0.5
    assert cfg.task.name == "synthetic" and cfg.task.options["lr"] == 0.5
    assert cfg.strategy.name == "fedavg"


def test_unknown_key_names_key_and_allowed_values():
    with pytest.raises(ConfigError, match=r"federation\.quorom: unknown key; allowed keys here: .*quorum"):
        from_mapping({"federation": {"quorom": 1}})


def test_literal_value_lists_choices():
    with pytest.raises(ConfigError, match=r"federation\.mode = 'fast' is not allowed; choose one of: sync, async"):
        from_mapping({"federation": {"mode": "fast"}})


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"rounds must be an integer"):
        from_mapping({"rounds": "many"})


def test_task_options_validated_by_task_config():
    with pytest.raises(ConfigError, match=r"task\.lrr: unknown key"):
        build(SyntheticTask.Config, {"lrr": 1}, where="x.yaml", prefix="task.")
    with pytest.raises(ConfigError, match=r"num_classes must be >= 2"):
        build(SyntheticTask.Config, {"num_classes": 1}, where="x.yaml", prefix="task.")


def test_malformed_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "missing.yaml")
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load(bad)


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="must look like key=value"):
        from_mapping({}, ["rounds"])


def test_config_hash_is_stable_and_sensitive():
    a = from_mapping({"rounds": 3}, source="a.yaml")
    b = from_mapping({"rounds": 3}, source="b.yaml")
    c = from_mapping({"rounds": 4})
    assert a.hash() == b.hash() != c.hash()
