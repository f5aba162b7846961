"""Config validation: every bad value gets an error that says what to use instead."""

import pytest

import quantlab
from quantlab import ConfigError, CustomBitsConfig, Int8SymmetricConfig, NF4Config


@pytest.mark.parametrize("bits", [0, 1, 9, 16, 3.5])
def test_custom_bits_outside_2_to_8(bits):
    with pytest.raises(ConfigError, match="from 2 to 8"):
        CustomBitsConfig(bits=bits)


@pytest.mark.parametrize("group_size", [16, 48, 512, 0])
def test_custom_bits_group_size(group_size):
    with pytest.raises(ConfigError, match="power of two from 32 to 256"):
        CustomBitsConfig(group_size=group_size)


def test_per_channel_is_none():
    assert CustomBitsConfig(group_size=None).group_size is None


def test_unknown_option_lists_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown option\(s\) bitz.*valid options: modules_to_not_convert, .*bits"):
        CustomBitsConfig.from_options({"bitz": 3})


def test_scale_dtype_choice():
    with pytest.raises(ConfigError, match=r"scale_dtype='float8'.*bfloat16"):
        Int8SymmetricConfig(scale_dtype="float8")


def test_nf4_blocksize():
    with pytest.raises(ConfigError, match="blocksize"):
        NF4Config(blocksize=100)


def test_newer_format_version_is_refused_with_upgrade_hint():
    data = NF4Config().to_dict() | {"format_version": 99}
    with pytest.raises(ConfigError, match="upgrade quantlab"):
        NF4Config.from_dict(data)


def test_config_is_public_and_serializable():
    config = quantlab.CustomBitsConfig(bits=3, group_size=128, symmetric=True, modules_to_not_convert=["lm_head"])
    data = config.to_dict()
    assert data == {
        "quant_method": "quantlab_custom_bits",
        "format_version": 1,
        "modules_to_not_convert": ["lm_head"],
        "solver": "rtn",
        "solver_options": None,
        "awq": False,
        "calibration_text": None,
        "self_calibration": False,
        "calibration_samples": 128,
        "calibration_seq_len": 256,
        "target_bits": None,
        "layer_options": None,
        "embedding_bits": None,
        "embedding_group_size": 64,
        "bits": 3,
        "group_size": 128,
        "symmetric": True,
        "scale_dtype": "float16",
    }
    assert CustomBitsConfig.from_dict(data) == config


@pytest.mark.parametrize("target_bits", [float("nan"), float("inf"), -2.0, 0, "3.5", True])
def test_target_bits_must_be_a_positive_finite_number(target_bits):
    with pytest.raises(ConfigError, match=r"target_bits=.* is not valid; use a positive finite number"):
        CustomBitsConfig(target_bits=target_bits, solver="gptq")
