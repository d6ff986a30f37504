"""An HF folder: config.json, *.safetensors (or pytorch_model*.bin), tokenizer files. Read through the
model's weight-name map; each rank cuts its shard as it reads; dense weights in the run dtype."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ...distributed import TPGroup
from ...errors import ModelLoadError
from ...platforms import current_platform
from ...tokenizer import Tokenizer
from ..layers.weight_formats import BlockRows
from ..layers.weight_methods import WeightMethods
from ..models.registry import ModelRegistry
from ..models.weight_names import has_module
from .base import (
    LoadedModel,
    build,
    check_complete,
    layer_linears,
    model_class,
    resolve_dtype,
    row_parallel_bias,
    set_param,
    shard_cols,
    shard_rows,
)

log = logging.getLogger("pagedllm")


def read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from e


def load_hf_folder(path: Path, dtype: str = "auto", quantization: str | None = None,
                   tp: TPGroup | None = None, registry: ModelRegistry | None = None, device: str = "cpu",
                  context: int | None = None, attention_backend: str = "auto", load_format: str = "auto") -> LoadedModel:
    """load_format "dummy": random weights of the config's shapes made on the device (vLLM's, for measuring a
    model's speed and memory without its checkpoint); the folder needs config.json alone."""
    raw = read_config(path)
    cls = model_class(raw, registry)
    names = cls.WEIGHTS
    cfg = cls.fit_context(cls.config_from_hf(raw), context)
    platform = current_platform(device, attention_backend)
    tdtype = resolve_dtype(dtype, raw, platform)
    if load_format == "dummy":
        if tp is not None:
            raise ModelLoadError("load_format='dummy' does not run under tensor parallelism")
        model = dummy_model(cls, cfg, tdtype, platform)
        return LoadedModel(model, cfg, _tokenizer(path, raw), path.name, path, tdtype)
    sd = _read_weights(path)
    cls.hf_tensors(sd, cfg)

    def take(name: str) -> torch.Tensor:
        if name not in sd:
            raise ModelLoadError(f"weight {name!r} missing from the checkpoint")
        return sd[name]

    model = build(cls, cfg, {lin.attr: any(f"{names.hf_layer.format(i)}{lin.parts[0].hf}.bias" in sd
                                           for i in range(cfg.num_layers)) for lin in names.linears}, tp)
    lm_head_name = names.lm_head.parts[0].hf + ".weight"
    if lm_head_name not in sd:
        cfg.tie_word_embeddings = True

    methods = WeightMethods(platform.kernels(tdtype), tdtype, quantization)
    blocks_dequantized = 0

    def linear(owner: torch.nn.Module, spec, prefix: str) -> None:
        """Stack the parts along the outputs, each cut to this rank's rows or columns first. Parts that arrive in
        a block format (BlockRows) run as stored where the kernels can, else are dequantized."""
        nonlocal blocks_dequantized
        ws, bs = [], []
        for p in spec.parts:
            name = f"{prefix}{p.hf}.weight"
            w = take(name)
            rows, cols = shard_rows(spec, p, w.shape[0], cfg, tp), shard_cols(spec, w.shape[1], tp)
            if isinstance(w, BlockRows):
                ws.append(w.select(rows, cols, name))
            else:
                w = w if rows is None else w[torch.from_numpy(rows)]
                ws.append(w if cols is None else w[:, cols[0]:cols[1]])
            if owner.get_submodule(spec.attr).bias is not None:
                b = take(f"{prefix}{p.hf}.bias")
                bs.append(b if rows is None else b[torch.from_numpy(rows)])
        bias = row_parallel_bias(torch.cat(bs).to(tdtype) if bs else None, spec, tp)
        lin = owner.get_submodule(spec.attr)
        if methods.runs_blocks([w.fmt if isinstance(w, BlockRows) else None for w in ws], ws[0].shape[1]):
            methods.set_blocks(model, lin, methods.blocks([(w.data, w.fmt) for w in ws], ws[0].in_features, bias),
                               bias)
            return
        if any(isinstance(w, BlockRows) for w in ws):
            blocks_dequantized += 1
            ws = [w.dequantize() if isinstance(w, BlockRows) else w for w in ws]
        methods.set_dense(lin, torch.cat(ws).to(tdtype), bias)

    def param(owner: torch.nn.Module, attr: str, name: str, vocab_rows: bool = False) -> None:
        w = take(name)
        if vocab_rows and tp is not None:
            w = w[slice(*tp.span(w.shape[0]))]
        owner.get_submodule(attr).weight = torch.nn.Parameter(w.to(tdtype), requires_grad=False)

    param(model, names.embed.attr, names.embed.hf + ".weight", vocab_rows=True)
    param(model, names.norm.attr, names.norm.hf + ".weight")
    for extra in names.extras:
        if has_module(model, extra.attr):
            param(model, extra.attr, extra.hf + ".weight")
    if cfg.tie_word_embeddings:
        model.tie_lm_head()
    else:
        linear(model, names.lm_head, "")
    for i, layer in enumerate(model.layers):
        prefix = names.hf_layer.format(i)
        for spec, _ in layer_linears(names, layer):
            linear(layer, spec, prefix)
        for n in names.norms:
            if hasattr(layer, n.attr) or has_module(layer, n.attr):  # a layer of one kind skips the other's
                set_param(layer, n, take(f"{prefix}{n.hf}.weight").to(tdtype), cfg, tp)
    sd.clear()  # the loaded tensors now belong to the model (or were cut from)
    if blocks_dequantized:
        log.warning("%d linears stored in a block format (MXFP4) dequantized at load to %s", blocks_dequantized,
                    str(tdtype).removeprefix("torch."))
    check_complete(model, path)
    if tp is not None:  # first: after_load reads this rank's head counts
        model.use_tensor_parallel(tp)
    model.after_load("hf")
    model.eval()
    methods.process(model, platform)
    return LoadedModel(model, cfg, _tokenizer(path, raw), path.name, path, tdtype)


def _tokenizer(path: Path, raw: dict) -> Tokenizer | None:
    eos = raw.get("eos_token_id")
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return Tokenizer.from_dir(path, eos_ids)


def dummy_model(cls: type, cfg, dtype: torch.dtype, platform) -> torch.nn.Module:
    """The model with random weights made where it runs: linears and embeddings N(0, 0.02), norms 1 (random
    norms would scale layers apart), no biases."""
    model = build(cls, cfg, {}, None).to(dtype)  # on meta: the cast is free
    model.to_empty(device=platform.device)
    gen = torch.Generator(device=platform.device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    if cfg.tie_word_embeddings:
        model.tie_lm_head()
    model.after_load("hf")
    model.eval()
    WeightMethods(platform.kernels(dtype), dtype, None).process(model, platform)
    return model


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    sd: dict[str, torch.Tensor] = {}
    if files:
        for f in files:
            sd.update(load_file(str(f)))
        return sd
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelLoadError(f"no *.safetensors or pytorch_model*.bin weights in {path}")
    for f in bins:
        sd.update(torch.load(f, map_location="cpu", weights_only=True))
    return sd
