"""kernels.tune's sweep modes are well formed (the sweeps themselves run on a GPU only)."""

import dataclasses

import pytest

from kernels import tune
from kernels.split_heuristic import FLAG_LETTERS, KernelConfig

FIELDS = {f.name for f in dataclasses.fields(KernelConfig)}


@pytest.mark.parametrize("name", sorted(tune.MODES))
def test_mode_is_well_formed(name):
    mode = tune.MODES[name]
    assert mode.help and mode.configs and all(isinstance(c, KernelConfig) for c in mode.configs)
    for (batch, ctx), splits in mode.splits.items():
        assert batch > 0 and ctx > 0 and splits and all(s >= 1 for s in splits)
    if mode.knob is not None:   # an A/B: both sides of the knob must be there to compare
        assert mode.knob == "workspace" or mode.knob in FIELDS
        if mode.knob in FIELDS:
            assert {getattr(c, mode.knob) for c in mode.configs} == {False, True}


def test_every_mode_but_the_full_sweep_has_a_flag(capsys):
    with pytest.raises(SystemExit):
        tune.main(["--help"])
    text = capsys.readouterr().out
    assert all(f"--{name.replace('_', '-')}" in text for name in tune.MODES if name != "full")


def test_every_config_flag_prints_as_its_own_letter():
    flags = [f.name for f in dataclasses.fields(KernelConfig)
             if f.type in (bool, "bool") and f.name != "offsets_32"]   # offsets_32 prints as /i64 when off
    assert set(FLAG_LETTERS) == set(flags)
    assert len(set(FLAG_LETTERS.values())) == len(flags)
    name = tune._cfg_name(dataclasses.asdict(KernelConfig(64, 4, 3, pdl=True, pdl_wait=True, evict_first=True,
                                                          early_table=True)))
    assert name == "64/4w/3s/E/P/F/W"
