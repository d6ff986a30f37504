"""Helpers shared by the tests: a `pagedllm serve` subprocess, HF's greedy continuation (the oracle), an HF
model's weights written as a GGUF under a model's declared names."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import torch


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    model.generation_config.eos_token_id = None  # like ignore_eos: exactly n tokens, EOS allowed
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str | None, *extra: str) -> None:
        """model None: the embedded default."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: the access log never fills a buffer
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedllm", "serve", *(["--model", model] if model else []),
                                      "--port", str(self.port), *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()}")
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server did not become ready")

    def output(self) -> str:
        """What the server printed so far."""
        self.log.seek(0)
        return self.log.read()

    def metrics(self) -> dict[str, float]:
        """Every pagedllm sample of one /metrics scrape (one engine snapshot), by name with its labels."""
        return {line.split()[0].removeprefix("pagedllm:"): float(line.split()[-1])
                for line in httpx.get(self.url + "/metrics").text.splitlines() if line.startswith("pagedllm:")}

    def metric(self, name: str, labels: str = "") -> float:
        return self.metrics().get(name + labels, 0.0)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def renamed_weights(hf_sd: dict, names, fmt: str, layers: int) -> dict:
    """HF Llama-family tensors (standard names) under another WeightNames' `fmt` ("hf" or "gguf") names."""
    from pagedllm.model_executor.models.llama import LlamaForCausalLM

    std = LlamaForCausalLM.WEIGHTS
    out = {}

    def put(a: str, b: str) -> None:
        for suffix in (".weight", ".bias"):
            if a + suffix in hf_sd:
                out[b + suffix] = hf_sd[a + suffix]

    put(std.embed.hf, getattr(names.embed, fmt))
    put(std.norm.hf, getattr(names.norm, fmt))
    put(std.lm_head.parts[0].hf, getattr(names.lm_head.parts[0], fmt))
    layer = names.hf_layer if fmt == "hf" else names.gguf_layer
    std_linears = {lin.attr: lin for lin in std.linears}
    std_norms = {n.attr: n for n in std.norms}
    for i in range(layers):
        src, dst = std.hf_layer.format(i), layer.format(i)
        for lin in names.linears:  # HF's tensor of the part's own name where it has one (Phi-3's qkv_proj)
            std_parts = std_linears[lin.attr].parts if lin.attr in std_linears else lin.parts
            for a, b in zip(std_parts, lin.parts):
                own = src + b.hf + ".weight" in hf_sd
                put(src + (b.hf if own else a.hf), dst + getattr(b, fmt))
        for norm in names.norms:
            put(src + std_norms.get(norm.attr, norm).hf, dst + getattr(norm, fmt))
    return out


def _write_config(w, c: dict) -> None:
    """An HF config's shared fields as `{arch}.*` metadata (Gemma 3: the global layers' rope base)."""
    w.add_block_count(c["num_hidden_layers"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_vocab_size(c["vocab_size"])
    w.add_key_length(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    rope = c.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 10000.0))


def write_gguf_from_hf(hf_model, path, arch: str, names, extra=None) -> None:
    """F32 tensors in HF's row order (no interleaved rope), the config as `{arch}.*` metadata, no tokenizer.
    extra(writer): more metadata and tensors, before the model's."""
    from gguf import GGUFWriter

    c = hf_model.config
    w = GGUFWriter(str(path), arch)
    _write_config(w, c.to_dict())
    if extra is not None:
        extra(w)
    sd = {k: v.float().numpy() for k, v in hf_model.state_dict().items()}
    for name, t in renamed_weights(sd, names, "gguf", c.num_hidden_layers).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf_from_folder(folder, path, arch: str, names, quant: str | None = None, norm_shift: float = 0.0,
                           expert_quant: str | None = None, vocab: bool = False, meta=None, transform=None) -> None:
    """The checkpoint of an HF folder (per-expert matrices, as the model's `hf_tensors` names them) as a GGUF of
    `names`' GGUF names: experts stacked into 3-D tensors, the config as `{arch}.*` metadata, no tokenizer.
    quant: a ggml type name for every linear's matrix (norms, biases, the embedding and routers stay F32);
    expert_quant: the experts' type, if another. vocab: a placeholder byte-level BPE vocabulary of the model's size
    (tokens "t0" ..., one merge), for an engine that will not load a file without one (llama.cpp). meta(writer,
    config): the architecture's own keys and tensors, written over the shared ones. transform(tensors, config): the
    values llama.cpp's converter writes in place of HF's (numpy arrays by HF name, changed in place)."""
    import json
    import math
    from pathlib import Path

    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
    from gguf.quants import quantize
    from safetensors.torch import load_file

    from pagedllm.model_executor.model_loader.gguf import unpermute_rows
    from pagedllm.model_executor.models.registry import default_registry

    folder = Path(folder)
    c = json.loads((folder / "config.json").read_text())
    cls = default_registry().model_class(c["architectures"][0])
    tensors = load_file(str(folder / "model.safetensors"))
    cls.hf_tensors(tensors, cls.config_from_hf(c))
    sd = {k: t.contiguous().numpy() for k, t in tensors.items()}
    if transform is not None:
        transform(sd, c)
    w = GGUFWriter(str(path), arch)
    _write_config(w, c)
    if vocab:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(c["vocab_size"])])
        w.add_token_types([1] * c["vocab_size"])
        w.add_token_merges(["t 0"])
    rope = c["rope_parameters"].get("full_attention", c["rope_parameters"])  # Gemma 3: the global layers' rope
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "llama3":  # per-pair divisors of the frequencies, as llama.cpp's converter writes
        d = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        lo, hi, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
        factors = []
        for i in range(d // 2):
            wavelen = 2 * math.pi * rope["rope_theta"] ** (2 * i / d)
            smooth = min(max((old / wavelen - lo) / (hi - lo), 0.0), 1.0)
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
        w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if c.get("sliding_window") is not None:
        w.add_sliding_window(c["sliding_window"])
    if c.get("clip_qkv") is not None:
        w.add_clamp_kqv(c["clip_qkv"])
    experts = c.get("num_experts") or c.get("num_local_experts") or 0
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.get("num_experts_per_tok") or c["top_k_experts"])
        w.add_expert_feed_forward_length(c.get("moe_intermediate_size") or c["intermediate_size"])

    if meta is not None:
        meta(w, c)
    written: set[str] = set()

    def put(name: str, t: np.ndarray, matrix: bool, qtype: str | None = quant) -> None:
        if name in written:  # one checkpoint tensor in two of the model's linears (Gemma 4's q in q/k/v and q/k)
            return
        written.add(name)
        if qtype is None or not matrix:
            w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
            return
        qt = GGMLQuantizationType[qtype.upper()]
        w.add_tensor(name, quantize(np.ascontiguousarray(t, dtype=np.float32), qt), raw_dtype=qt)

    put(names.embed.gguf + ".weight", sd[names.embed.hf + ".weight"], False)
    put(names.norm.gguf + ".weight", sd[names.norm.hf + ".weight"] + norm_shift, False)
    if names.lm_head.parts[0].hf + ".weight" in sd:
        put(names.lm_head.parts[0].gguf + ".weight", sd[names.lm_head.parts[0].hf + ".weight"], True)
    for p in names.extras:
        if p.hf + ".weight" in sd:
            put(p.gguf_tensor, sd[p.hf + ".weight"], False)
    for i in range(c["num_hidden_layers"]):
        src, dst = names.hf_layer.format(i), names.gguf_layer.format(i)
        for lin in names.linears:
            for p in lin.parts:
                if src + p.hf + ".weight" in sd:
                    t = sd[src + p.hf + ".weight"]
                    if p.rope_heads and arch in names.gguf_interleaved_rope:  # as llama.cpp's converter does
                        heads = c["num_attention_heads"] if p.rope_heads == "num_heads" else c["num_key_value_heads"]
                        t = t[np.argsort(unpermute_rows(t.shape[0], heads))]
                    put(dst + p.gguf + ".weight", t, lin.parallel != "replicated")
                if src + p.hf + ".bias" in sd:
                    put(dst + p.gguf + ".bias", sd[src + p.hf + ".bias"], False)
        for n in names.norms:  # norm_shift: llama.cpp's Gemma converter stores 1 + w
            if src + n.hf + ".weight" in sd:  # a layer of one kind skips the other kind's
                put(dst + n.gguf_tensor, sd[src + n.hf + ".weight"] + norm_shift, False)
        for lin in names.experts:
            for p in lin.parts:
                for kind, matrix in ((".weight", True), (".bias", False)):
                    if src + p.hf.format(e=0) + kind in sd:
                        stacked = np.stack([sd[src + p.hf.format(e=e) + kind] for e in range(experts)])
                        put(dst + p.gguf + kind, stacked, matrix, expert_quant or quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gemma4_gguf_keys(w, c: dict) -> None:
    """A `gemma4` file's own keys and rope tensor, as llama.cpp's converter writes them (checked against its output
    for these configs): per-layer KV heads and MLP widths as arrays, the global head size as `key_length` and the
    sliding one as `key_length_swa`, the global layers' proportional rope as `rope_freqs` factors of 1 and 1e30."""
    import numpy as np

    n, types = c["num_hidden_layers"], c["layer_types"]
    shared = c.get("num_kv_shared_layers") or 0
    full = {int(k): v for k, v in (c.get("per_layer_config") or {}).items()}
    d_full = next(v["head_dim"] for v in full.values() if "head_dim" in v)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    w.add_key_length(d_full)
    w.add_value_length(d_full)
    w.add_key_length_swa(c["head_dim"])
    w.add_value_length_swa(c["head_dim"])
    w.add_head_count_kv([full.get(i, {}).get("num_key_value_heads", c["num_key_value_heads"]) for i in range(n)])
    ff = c["intermediate_size"]
    if c.get("use_double_wide_mlp"):
        w.add_feed_forward_length([ff * 2 if i >= n - shared else ff for i in range(n)])
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(c.get("hidden_size_per_layer_input") or 0)
    rope = c["rope_parameters"]
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_rope_dimension_count(d_full)
    w.add_rope_dimension_count_swa(c["head_dim"])
    if c.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
    pairs = d_full // 2
    rotated = int(pairs * rope["full_attention"]["partial_rotary_factor"])
    w.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (pairs - rotated), dtype=np.float32))


def phi3_gguf_keys(w, c: dict) -> None:
    """A `phi3` file's own keys, as llama.cpp's converter writes them: the padding token, and LongRoPE (Phi-4-mini)
    as the rotary dims, the original context and the attention factor in metadata, its factors as tensors."""
    import math

    import numpy as np

    if c.get("pad_token_id") is not None:
        w.add_pad_token_id(c["pad_token_id"])
    rope = c.get("rope_parameters") or {}
    if "long_factor" not in rope:
        return
    w.add_rope_dimension_count(int(c["hidden_size"] // c["num_attention_heads"] * rope["partial_rotary_factor"]))
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    scale = c["max_position_embeddings"] / rope["original_max_position_embeddings"]
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"])))
    w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def qwen35_gguf_keys(w, c: dict) -> None:
    """A `qwen35` / `qwen35moe` file's own keys, as llama.cpp's converter writes them."""
    n = c["num_hidden_layers"]
    w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    w.add_ssm_state_size(c["linear_key_head_dim"])
    w.add_ssm_group_count(c["linear_num_key_heads"])
    w.add_ssm_time_step_rank(c["linear_num_value_heads"])
    w.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
    w.add_array(f"{w.arch}.attention.recurrent_layers", [t == "linear_attention" for t in c["layer_types"]][:n])
    w.add_full_attention_interval(c.get("full_attention_interval", 4))
    rotated = int(c["head_dim"] * c["rope_parameters"]["partial_rotary_factor"])
    w.add_rope_dimension_count(rotated)
    # the multimodal rope's sections (one position stream for text: any split is the same rope); the converter's
    # default [11, 11, 10] is wider than a tiny head, which llama.cpp refuses: all pairs in the first section then
    w.add_rope_dimension_sections(c["rope_parameters"].get("mrope_section") or [rotated // 2, 0, 0, 0])
    if c.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])


def qwen35_converter_values(sd: dict, c: dict) -> None:
    """What llama.cpp's converter stores in place of HF's Qwen3.5 tensors: -exp(A_log), the (1 + w) norms (not the
    gated one), the conv kernels [C, K], and with fewer key heads than value heads every value-head axis reordered
    from grouped by key head (HF) to tiled (v0 of each key head, then v1, ...)."""
    import numpy as np

    hk, hv, dk, dv = (c[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                     "linear_value_head_dim"))

    def tiled(t: np.ndarray, axis: int, d: int) -> np.ndarray:
        t = np.moveaxis(t, axis, 0)
        shape = t.shape
        t = t.reshape(hk, hv // hk, d, *shape[1:]).swapaxes(0, 1).reshape(shape)
        return np.ascontiguousarray(np.moveaxis(t, 0, axis))

    for name in list(sd):
        t = sd[name]
        if name.endswith("A_log.weight"):
            t = -np.exp(t)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        elif name.endswith("conv1d.weight"):
            t = t.squeeze(1)
        if "linear_attn." in name and hk != hv:
            if name.endswith("in_proj_qkv.weight"):
                t = np.concatenate([t[:2 * hk * dk], tiled(t[2 * hk * dk:], 0, dv)])
            elif name.endswith("in_proj_z.weight"):
                t = tiled(t, 0, dv)
            elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log.weight", "dt_bias.weight")):
                t = tiled(t, 0, 1)
            elif name.endswith("conv1d.weight"):
                t = np.concatenate([t[:2 * hk * dk], tiled(t[2 * hk * dk:], 0, dv)])
            elif name.endswith("out_proj.weight"):
                t = tiled(t, 1, dv)
        sd[name] = t
