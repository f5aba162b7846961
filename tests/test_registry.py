"""The method registry: names, errors, transformers registration, plugin discovery."""

import dataclasses
import subprocess
import sys
import textwrap

import pytest
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

import quantlab
import quantlab.utils.entry_points
from quantlab import registry
from quantlab.integrations.transformers import quantizer_class_of, reserve_plugin_methods
from quantlab.methods.int8 import Int8Linear


class BrokenEntryPoint:
    """An installed plugin whose entry point fails to import."""

    name, value = "broken", "nowhere:register"

    def load(self):
        raise ImportError("no module named nowhere")


def install_broken_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the registry see `BrokenEntryPoint` as the only plugin, not yet discovered."""
    monkeypatch.setattr(registry, "_plugins_discovered", False)
    plugins = {registry.ENTRY_POINT_GROUP: [BrokenEntryPoint()]}
    monkeypatch.setattr(registry, "entry_points", lambda group: plugins.get(group, []))
    monkeypatch.setattr(quantlab.utils.entry_points, "entry_points", lambda group: plugins.get(group, []))


def test_builtin_methods_are_listed():
    assert {"int8", "nf4", "custom_bits"} <= set(quantlab.list_methods())


def test_unknown_method_lists_known_ones():
    with pytest.raises(
        quantlab.UnknownMethodError, match=r"unknown quantization method 'int3'.*custom_bits.*int8.*nf4"
    ):
        quantlab.get_method("int3")


def test_methods_are_registered_with_transformers():
    method = quantlab.get_method("nf4")
    assert AUTO_QUANTIZATION_CONFIG_MAPPING["quantlab_nf4"] is method.config_class
    assert AUTO_QUANTIZER_MAPPING["quantlab_nf4"] is quantizer_class_of(method)
    assert method.quantizer_class is None  # the registry built nothing for transformers: the integration did


def test_registering_the_same_classes_again_is_a_no_op():
    method = quantlab.get_method("int8")
    assert quantlab.register_method(method.config_class, method.module_class) is method


def test_a_different_method_under_a_taken_name_raises():
    @dataclasses.dataclass(repr=False)
    class OtherInt8(quantlab.Int8SymmetricConfig):
        method = "int8"

    with pytest.raises(ValueError, match="already registered"):
        quantlab.register_method(OtherInt8, Int8Linear)


def test_method_names_must_be_lowercase():
    @dataclasses.dataclass(repr=False)
    class Shouty(quantlab.Int8SymmetricConfig):
        method = "Int9"

    with pytest.raises(ValueError, match="lowercase"):
        quantlab.register_method(Shouty, Int8Linear)


def test_a_broken_plugin_warns_instead_of_failing(monkeypatch):
    install_broken_plugin(monkeypatch)
    with pytest.warns(RuntimeWarning, match="plugin 'broken'.*failed to load"):
        registry.discover_plugins()
    assert "int8" in quantlab.list_methods()


@pytest.mark.subprocess
def test_import_does_not_load_plugins_until_asked():
    script = textwrap.dedent(
        """
        import quantlab, quantlab.registry as r
        assert not r._plugins_discovered
        quantlab.list_methods()
        assert r._plugins_discovered
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env={"QUANTLAB_AUTOLOAD": "0"}
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_checkpoint_of_a_plugin_that_fails_to_register_raises_a_clear_error(monkeypatch, tmp_path):
    """Installed plugins hold their name in transformers' table; if the plugin then fails to
    register, loading its checkpoint names the problem instead of loading codes as weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    from quantlab.errors import UnknownMethodError
    from quantlab.integrations.transformers import PendingPluginConfig, PendingPluginQuantizer
    from quantlab.testing import tiny_llama

    install_broken_plugin(monkeypatch)
    monkeypatch.delitem(AUTO_QUANTIZATION_CONFIG_MAPPING, "quantlab_broken", raising=False)
    monkeypatch.delitem(AUTO_QUANTIZER_MAPPING, "quantlab_broken", raising=False)
    reserve_plugin_methods()
    assert AUTO_QUANTIZATION_CONFIG_MAPPING["quantlab_broken"] is PendingPluginConfig
    assert AUTO_QUANTIZER_MAPPING["quantlab_broken"] is PendingPluginQuantizer

    tiny_llama().save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    config.quantization_config = {"quant_method": "quantlab_broken", "bits": 4}
    config.save_pretrained(tmp_path)
    with pytest.warns(RuntimeWarning, match="plugin 'broken'"), pytest.raises(UnknownMethodError, match="plugin"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    del AUTO_QUANTIZATION_CONFIG_MAPPING["quantlab_broken"]
    del AUTO_QUANTIZER_MAPPING["quantlab_broken"]


def test_subscribers_hear_of_methods_registered_before_and_after(monkeypatch):
    """Integrations subscribe to the registry instead of the registry building their objects."""
    monkeypatch.setattr(registry, "_SUBSCRIBERS", [])
    heard: list[str] = []
    registry.subscribe(lambda method: heard.append(method.name))
    assert {"int8", "nf4", "custom_bits"} <= set(heard)

    @dataclasses.dataclass(repr=False)
    class LateConfig(quantlab.Int8SymmetricConfig):
        method = "late_subscriber_test"

    class LateLinear(Int8Linear):
        config_class = LateConfig

    registry.register_method(LateConfig, LateLinear)
    try:
        assert heard[-1] == "late_subscriber_test"
    finally:
        del registry._METHODS["late_subscriber_test"]
