"""The standard QLoRA recipe, unchanged, on quantlab checkpoints, in processes that import only transformers and peft.

quantlab is installed (its start-up hook registers it) but the scripts never import it: load a
saved quantized checkpoint, `prepare_model_for_kbit_training`, `LoraConfig(target_modules="all-linear")`,
`get_peft_model`, a few `transformers.Trainer` steps, save the adapter; then a second fresh
process reloads it with `PeftModel.from_pretrained`, must reproduce the logits bit for bit, and
`merge_and_unload()` there warns once (`RequantizationWarning`) that merging re-quantized the base.
Every registered method runs, plugins included (the hqq plugin when installed), one after another in
the same two processes.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantlab.registry import get_method, list_methods
from quantlab.testing import tiny_llama

pytestmark = pytest.mark.subprocess

METHODS = list_methods()

_PROBE = "torch.arange(48).reshape(2, 24) * 5 % 256"

_TRAIN = textwrap.dedent(
    f"""
    import contextlib, io, json, sys, traceback
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    float_dir, runs = sys.argv[1], json.loads(sys.argv[2])  # runs: method -> [quantized_dir, out]

    class Pattern(torch.utils.data.Dataset):
        def __len__(self):
            return 64
        def __getitem__(self, i):
            ids = (torch.arange(24) + i) % 13 + 10
            return {{"input_ids": ids, "labels": ids.clone()}}

    def lora_config():
        return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")

    def trainable_line(peft_model):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            peft_model.print_trainable_parameters()
        return printed.getvalue().strip()

    float_model = AutoModelForCausalLM.from_pretrained(float_dir)
    float_count = float_model.num_parameters()
    float_line = trainable_line(get_peft_model(float_model, lora_config()))

    def train(quantized_dir, out):
        model = AutoModelForCausalLM.from_pretrained(quantized_dir)
        quantized_count = model.num_parameters()
        model = prepare_model_for_kbit_training(model)
        checkpointing = model.is_activation_checkpointing
        torch.manual_seed(0)
        model = get_peft_model(model, lora_config())
        args = TrainingArguments(
            output_dir=out + "/run", max_steps=10, per_device_train_batch_size=8, learning_rate=1e-2,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=Pattern())
        trainer.train()
        model.save_pretrained(out + "/adapter")
        model.eval()
        with torch.no_grad():
            torch.save(model(input_ids={_PROBE}).logits, out + "/logits.pt")
        adapted = [m for m in model.modules() if hasattr(m, "lora_A")]
        base_types = sorted({{type(m.get_base_layer()).__module__ for m in adapted}})
        return {{
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "targets": sorted(model.peft_config["default"].target_modules),
            "base_layer_modules": base_types,
            "checkpointing": checkpointing,
            "float_count": float_count,
            "quantized_count": quantized_count,
            "float_line": float_line,
            "quantized_line": trainable_line(model),
            "quantlab_loaded_by_hook": "quantlab" in sys.modules,
        }}

    results = {{}}
    for method, (quantized_dir, out) in runs.items():
        try:
            results[method] = train(quantized_dir, out)
        except Exception:
            results[method] = {{"error": traceback.format_exc()[-3000:]}}
    print(json.dumps(results))
    """
)

_RELOAD = textwrap.dedent(
    f"""
    import json, sys, traceback
    import warnings
    import torch
    from transformers import AutoModelForCausalLM
    from peft import PeftModel

    def reload(quantized_dir, out):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(quantized_dir), out + "/adapter")
        model.eval()
        with torch.no_grad():
            logits = model(input_ids={_PROBE}).logits
        if not torch.equal(logits, torch.load(out + "/logits.pt")):
            return "the reloaded adapter's logits differ from the trained model's"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            merged = model.merge_and_unload()
        named = [w for w in caught if type(w.message).__name__ == "RequantizationWarning"]
        if len(named) != 1 or "merge_to_float" not in str(named[0].message):  # once, naming the float merge
            return f"merge_and_unload warned {{[str(w.message) for w in caught]}}"
        with torch.no_grad():
            merged_logits = merged(input_ids={_PROBE}).logits
        if not (torch.isfinite(merged_logits).all() and merged_logits.shape == logits.shape):
            return "the merged model's logits are not finite or not of the adapter's shape"
        return "ok"

    results = {{}}
    for method, (quantized_dir, out) in json.loads(sys.argv[1]).items():
        try:
            results[method] = reload(quantized_dir, out)
        except Exception:
            results[method] = traceback.format_exc()[-3000:]
    print(json.dumps(results))
    """
)


def _run(script: str, *args: object) -> subprocess.CompletedProcess:
    assert "import quantlab" not in script and "from quantlab" not in script  # the recipe never imports it
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory) -> dict[str, dict]:
    """Every method quantized here, then trained in one fresh process and reloaded in a second one
    (two interpreters for all methods): method -> its quantized folder, training result and reload verdict."""
    root = tmp_path_factory.mktemp("recipe")
    float_dir = root / "float"
    tiny_llama(0).save_pretrained(float_dir)
    runs = {}
    for method in METHODS:
        quantized_dir, out = root / method / "quantized", root / method
        config = get_method(method).config_class()
        AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=config).save_pretrained(quantized_dir)
        runs[method] = [str(quantized_dir), str(out)]

    trained = _run(_TRAIN, float_dir, json.dumps(runs))
    assert trained.returncode == 0, trained.stderr[-3000:]
    results = json.loads(trained.stdout.strip().splitlines()[-1])
    reloadable = {method: runs[method] for method, result in results.items() if "error" not in result}
    reloaded = _run(_RELOAD, json.dumps(reloadable))
    assert reloaded.returncode == 0, reloaded.stderr[-3000:]
    verdicts = json.loads(reloaded.stdout.strip().splitlines()[-1])
    return {
        method: {"quantized_dir": Path(runs[method][0]), "trained": results[method], "reloaded": verdicts.get(method)}
        for method in METHODS
    }


@pytest.mark.parametrize("method", METHODS)
def test_qlora_recipe_trains_saves_and_reloads_without_importing_quantlab(method, recipe_runs):
    run = recipe_runs[method]
    result = run["trained"]
    assert "error" not in result, result.get("error")
    assert result["quantlab_loaded_by_hook"]
    assert result["base_layer_modules"] == [type(_first_quantized(run["quantized_dir"])).__module__]
    projections = {f"model.layers.{i}.{p}" for i in range(2) for p in _PROJECTIONS}
    assert set(result["targets"]) == projections  # "all-linear": every projection, not lm_head
    assert result["checkpointing"]
    losses = result["losses"]
    assert len(losses) == 10 and max(losses[-3:]) < 0.9 * losses[0], losses
    assert result["quantized_count"] == result["float_count"]
    assert result["quantized_line"] == result["float_line"]
    assert run["reloaded"] == "ok", run["reloaded"]


_PROJECTIONS = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]


def _first_quantized(directory: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(directory).model.layers[0].self_attn.q_proj
