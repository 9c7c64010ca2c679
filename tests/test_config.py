from pathlib import Path

import pytest

from hpcfed.config import ConfigError, from_mapping, load
from hpcfed.registry import resolve
from hpcfed.schema import build
from hpcfed.tasks.synthetic import SyntheticTask

REPO = Path(__file__).resolve().parents[1]


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


# -- overrides, hostile YAML, value ranges (issue 17, issue 12 item 5) ----------------------------------
def test_override_values_are_parsed_safely_in_one_line():
    for item in ["key=!!python/object/apply:os.system ['echo pwned']", "rounds=!!python/name:os.system",
                 "rounds=[1"]:
        with pytest.raises(ConfigError) as err:
            from_mapping({}, [item])
        assert str(err.value).startswith(f"command line ({item}): not valid YAML") and "\n" not in str(err.value)


# 9 levels of 9 aliases: ~390 bytes of YAML that expands to 9**9 = 387 million strings
BOMB = 'a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9))


def test_yaml_alias_bomb_is_refused_before_it_is_built(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    assert path.stat().st_size < 600
    with pytest.raises(ConfigError,
                       match=r"bomb\.yaml: YAML expands to more than 1,000,000 values through its aliases"):
        load(path)
    with pytest.raises(ConfigError, match=r"command line \(task\.x=.*\): YAML expands to more than"):
        from_mapping({}, ["task.x=" + "{" + BOMB.replace("\n", ", ").rstrip(", ") + "}"])
    path.write_text("a: &a [1, *a]\n")
    with pytest.raises(ConfigError, match=r"recursive alias"):
        load(path)
    path.write_text("rounds: 3\nx: &x [1, 2]\ny: [*x, *x]\n")  # ordinary aliases still work (then x is unknown)
    with pytest.raises(ConfigError, match=r"\bx: unknown key"):
        load(path)


def test_nothing_is_expanded_by_data_manifest_either(tmp_path):
    from hpcfed.data.manifest import load_manifest

    path = tmp_path / "data_manifest.yaml"
    path.write_text("datasets:\n  " + BOMB.replace("\n", "\n  "))
    with pytest.raises(ConfigError, match="YAML expands"):
        load_manifest(path)


@pytest.mark.parametrize("override, match", [
    ("rounds=-3", r"^command line \(rounds=-3\): rounds must be >= 1, got -3$"),
    ("rounds=0", r"rounds must be >= 1, got 0"),
    ("federation.quorum=1.5",
     r"^command line \(federation\.quorum=1\.5\): federation\.quorum must be a fraction in \(0, 1\]"),
    ("federation.round_deadline_s=0", r"federation\.round_deadline_s must be > 0"),
    ("keep_checkpoints=0", r"keep_checkpoints must be >= 1"),
    ("comm.chunk_bytes=-1", r"comm\.chunk_bytes must be >= 1"),
    ("federation.slowdown={1: -2}", r"federation\.slowdown\.1 must be > 0"),
])
def test_out_of_range_values_are_refused_and_blamed_on_the_command_line(override, match):
    with pytest.raises(ConfigError, match=match):
        load(REPO / "configs" / "quickstart.yaml", [override])


def test_bad_values_in_the_file_are_blamed_on_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rounds: -3\n")
    with pytest.raises(ConfigError, match=r"^.*c\.yaml: rounds must be >= 1, got -3$"):
        load(path, ["seed=1"])
    with pytest.raises(ConfigError, match=r"c\.yaml: rounds must be >= 1"):
        load(path, ["federation.quorum=0.5"])


def test_unknown_keys_get_a_did_you_mean():
    with pytest.raises(ConfigError, match=r"^command line \(round=5\): round: unknown key; .*did you mean 'rounds'\?$"):
        from_mapping({}, ["round=5"])
    with pytest.raises(ConfigError, match=r"federation\.quorom: unknown key; .*did you mean 'quorum'\?"):
        from_mapping({"federation": {"quorom": 1}})
    with pytest.raises(ConfigError, match=r"task\.lrr: unknown key; .*did you mean 'lr'\?"):
        build(SyntheticTask.Config, {"lrr": 1}, where="x.yaml", prefix="task.")
    with pytest.raises(ConfigError) as err:
        from_mapping({"zzzzzz": 1})
    assert "did you mean" not in str(err.value) and "source" not in str(err.value)


def test_task_option_errors_name_the_override():
    from hpcfed.launch.parent import prepare_config

    with pytest.raises(ConfigError, match=r"^command line \(task\.num_classes=1\): task\.num_classes must be >= 2"):
        prepare_config(str(REPO / "configs" / "quickstart.yaml"), ["task.num_classes=1"])
    with pytest.raises(ConfigError, match=r"^command line \(task\.lrr=1\): task\.lrr: unknown key"):
        prepare_config(str(REPO / "configs" / "quickstart.yaml"), ["task.lrr=1"])
    with pytest.raises(ConfigError, match=r"^command line \(strategy=nope\): strategy\.name: unknown strategy 'nope'"):
        prepare_config(str(REPO / "configs" / "quickstart.yaml"), ["strategy=nope"])


def test_resume_compatibility_names_what_differs():
    from hpcfed.config import check_resume_compatible

    saved = load(REPO / "configs" / "quickstart.yaml").to_dict()
    check_resume_compatible(saved, load(REPO / "configs" / "quickstart.yaml",
                                        ["rounds=20", "federation.round_deadline_s=5"]))
    with pytest.raises(ConfigError, match=r"^--resume: ck\.h5 was written by a different run configuration "
                                          r"\(strategy\.name: 'fedavg' in the checkpoint, 'median' now; "
                                          r"strategy\.weighting: 'num_examples' in the checkpoint, None now\)"):
        check_resume_compatible(saved, from_mapping({**saved, "strategy": {"name": "median"}}), where="ck.h5")
    with pytest.raises(ConfigError, match=r"task\.lr: 0\.005 in the checkpoint, 0\.1 now"):
        check_resume_compatible(saved, load(REPO / "configs" / "quickstart.yaml", ["task.lr=0.1"]))
    # the mode follows from the strategy, so another kind of strategy is what differs
    with pytest.raises(ConfigError, match=r"strategy\.name: 'fedavg' in the checkpoint, 'fedasync' now"):
        check_resume_compatible(saved, load(REPO / "configs" / "quickstart.yaml", ["strategy=fedasync"]))
    # a checkpoint whose config recorded the mode (every resolved one does) resumes under the same config
    resolved = load(REPO / "configs" / "quickstart.yaml")
    resolve(resolved)
    check_resume_compatible(resolved.to_dict(), load(REPO / "configs" / "quickstart.yaml"))


# -- the mode follows from the strategy -----------------------------------------------------------


@pytest.mark.parametrize("strategy, mode", [("fedavg", "sync"), ("median", "sync"), ("local", "sync"),
                                            ("feddwa", "async"), ("fedasync", "async"), ("afed", "async")])
def test_mode_is_derived_from_the_strategy(strategy, mode):
    cfg = from_mapping({"strategy": strategy, "task": "synthetic"})
    assert cfg.federation.mode is None  # nothing sets it
    resolve(cfg)
    assert cfg.mode == mode and cfg.federation.mode == mode and cfg.to_dict()["federation"]["mode"] == mode


def test_a_mode_that_agrees_is_accepted():
    cfg = from_mapping({"strategy": "fedasync", "federation": {"mode": "async"}})
    resolve(cfg)
    assert cfg.mode == "async"


@pytest.mark.parametrize("where, overrides, message", [
    ("file", [], r"/bad\.yaml: federation\.mode = 'async' disagrees with strategy 'fedavg', which is synchronous: "
                 r"the mode follows from the strategy; remove federation\.mode, or choose an asynchronous one"),
    ("cli", ["strategy=feddwa", "federation.mode=sync"],
     r"^command line \(federation\.mode=sync\): federation\.mode = 'sync' disagrees with strategy 'feddwa', "
     r"which is asynchronous: .*remove federation\.mode, or choose a synchronous one"),
])
def test_a_mode_that_disagrees_is_one_line_naming_the_key_and_the_fix(tmp_path, where, overrides, message):
    path = tmp_path / "bad.yaml"
    path.write_text("strategy: fedavg\nfederation:\n  mode: async\n" if where == "file" else "strategy: fedavg\n")
    cfg = load(path, overrides)
    with pytest.raises(ConfigError, match=message) as err:
        resolve(cfg)
    assert "\n" not in str(err.value)


def test_a_method_preset_does_not_override_a_contradicting_mode(tmp_path):
    """A method picks the strategy; a config that also forces the other mode is refused, not silently changed."""
    with pytest.raises(ConfigError, match=r"federation\.mode = 'async' disagrees with strategy 'fedavg'"):
        resolve(load(REPO / "configs" / "fedahe_synthetic.yaml", ["method=fedavg", "federation.mode=async"]))


def test_the_mode_is_unknown_until_resolved():
    cfg = from_mapping({"strategy": "fedavg"})
    with pytest.raises(ConfigError, match=r"not known until its strategy is looked up: pass the config through "
                                          r"hpcfed\.registry\.resolve first"):
        _ = cfg.mode
