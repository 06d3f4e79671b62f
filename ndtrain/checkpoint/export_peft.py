"""`ndtrain export RUN_DIR OUT --format peft`: a LoRA run's adapters as a peft adapter folder.

OUT gets `adapter_config.json` (peft's `LoraConfig` fields: r, lora_alpha, lora_dropout, the adapted
modules as `target_modules`) and `adapter_model.safetensors` with each adapter under peft's key
names, `base_model.model.<module path>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r], the
module path being the Hugging Face model's: an `hf:PATH` run's own, a built-in Llama's its
`LlamaForCausalLM` name (models/llama_hf.py). `peft.PeftModel.from_pretrained(base, OUT)` on the
base model (the `--format hf` export of the run before training, or the model it started from)
then computes what the run's model computes. Written into `OUT.partial` and renamed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ndtrain.checkpoint.export_hf import check_new_folder, write_folder
from ndtrain.checkpoint.run_model import load_run
from ndtrain.config import TrainConfig
from ndtrain.errors import UserError
from ndtrain.models.hf import is_hf_model
from ndtrain.models.llama_hf import llama_names_to_hf
from ndtrain.parallel.model.lora import LoRALinear, lora_layers

PREFIX = "base_model.model."


def hf_module_path(name: str, cfg: TrainConfig) -> str:
    """A module's path in the Hugging Face model the run corresponds to."""
    if is_hf_model(cfg.model.preset):
        return name.removeprefix("hf.")
    return next(iter(llama_names_to_hf({f"{name}.weight": torch.empty(0)}))).removesuffix(".weight")


def adapter_files(layers: dict[str, LoRALinear], cfg: TrainConfig) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """peft's adapter config and tensors for `layers` (module name → adapted layer)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, layer in layers.items():
        path = PREFIX + hf_module_path(name, cfg)
        tensors[f"{path}.lora_A.weight"] = layer.lora.A.detach().cpu().contiguous().clone()
        tensors[f"{path}.lora_B.weight"] = layer.lora.B.detach().cpu().contiguous().clone()
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora.r, "lora_alpha": cfg.lora.alpha,
        "lora_dropout": cfg.lora.dropout, "target_modules": sorted(hf_module_path(n, cfg) for n in layers),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True,
        "inference_mode": True, "base_model_name_or_path": None,
    }
    return config, tensors


def export_peft(run_dir: Path, out: Path) -> tuple[Path, list[str]]:
    """Write RUN_DIR's newest verified checkpoint's adapters as a peft folder OUT; return the checkpoint and
    the names of the files written."""
    check_new_folder(out)
    cfg, model, checkpoint = load_run(run_dir)
    layers = lora_layers(model)
    if not layers:
        raise UserError(f"--format peft writes LoRA adapters and {str(run_dir)!r} trained none (lora.r=0): "
                        "export it with --format hf or safetensors")
    config, tensors = adapter_files(layers, cfg)

    def write(tmp: Path) -> None:
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})

    return checkpoint, write_folder(out, write)
