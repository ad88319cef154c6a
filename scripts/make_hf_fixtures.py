"""Build the Hugging Face fixtures of tests/test_convert*.py with the PyTorch reference.

Needs torch, transformers >= 5 (``kimi_linear`` is native; on CPU it runs its PyTorch fallbacks of
the short conv and the chunked KDA), safetensors and compressed-tensors; the tests themselves need
none of them. Run from the repository root:

    python scripts/make_hf_fixtures.py            # writes tests/fixtures/hf/
    python scripts/make_hf_fixtures.py --check-export DIR   # transformers loads a to-hf output

``--check-export`` loads a directory written by ``python -m k3jax.convert to-hf`` (from the
imported ``kimi_linear`` fixture) with transformers, asserts no tensor is missing or unexpected and
prints the relative RMS error of its fp32 logits against the stored ones (0 for an fp32 export).

Writes:
* ``kimi_linear/``: a tiny random Kimi Linear (KDA, MLA and MoE layers, a dense layer 0), fp32, in
  the released layout (dense FFN under ``mlp.``), reloaded by transformers to check it reads it;
  router biases are non-zero and change the top-k of some tokens in every MoE layer.
* ``kimi_linear_bf16.json``: names, shapes and dtypes of the same model saved by transformers in
  bf16 (what an exported file must match).
* ``kimi_k3/``: a K3-layout model from the same weights plus the K3 tensors (AttnRes, latent MoE,
  full-rank gates), routed experts MXFP4-packed, two shards with an index.
* ``expected.npz``: tokens and transformers' logits; compressed-tensors' decoding of one layer's
  packed experts; the released AttnRes mix on random sources with the K3 file's weights.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import MXFP4A16
from safetensors.torch import load_file, save_file
from transformers import KimiLinearConfig, KimiLinearForCausalLM

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"
LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention",
          "full_attention"]
D, VOCAB, EXPERTS, TOP_K, MOE_INTER = 64, 256, 8, 2, 16
K3_LATENT, K3_INTER, A_LOG_PAD = 32, 32, 8


def kimi_linear_config() -> KimiLinearConfig:
    return KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=48, moe_intermediate_size=MOE_INTER,
        num_hidden_layers=len(LAYERS), num_attention_heads=2, num_key_value_heads=2,
        n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        v_head_dim=16, qk_nope_head_dim=16, num_experts_per_tok=TOP_K, num_local_experts=EXPERTS,
        linear_head_dim=16, linear_num_heads=2, layer_types=LAYERS,
        mlp_layer_types=["dense"] + ["sparse"] * (len(LAYERS) - 1), routed_scaling_factor=2.446,
        initializer_range=0.05, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Norm weights away from 1 (a swapped norm must show) and router biases that matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))


def check_bias_changes_top_k(model, tokens) -> None:
    """Every MoE layer routes some token differently with and without its bias."""
    seen = {}

    def hook(module, args):
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        scores = torch.sigmoid(x @ module.weight.float().T)
        plain = scores.topk(TOP_K, -1).indices.sort(-1).values
        biased = (scores + module.e_score_correction_bias).topk(TOP_K, -1).indices.sort(-1).values
        seen[id(module)] = bool((plain != biased).any())

    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    handles = [g.register_forward_pre_hook(hook) for g in gates]
    with torch.no_grad():
        model(tokens)
    for h in handles:
        h.remove()
    assert len(seen) == len(gates) and all(seen.values()), seen


def released_layout(state: dict, config: KimiLinearConfig) -> dict:
    """transformers saves dense FFNs under ``block_sparse_moe.``; released files use ``mlp.``."""
    out = {}
    for k, v in state.items():
        layer = int(k.split(".")[2]) if k.startswith("model.layers.") else None
        if layer is not None and config.mlp_layer_types[layer] == "dense":
            k = k.replace(".block_sparse_moe.", ".mlp.")
        out[k] = v.contiguous()
    return out


def write_kimi_linear(gen: torch.Generator) -> tuple[dict, dict, np.ndarray, np.ndarray]:
    config = kimi_linear_config()
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(config).float().eval()
    randomise(model, gen)
    tokens = torch.randint(3, VOCAB, (2, 12), generator=gen)
    check_bias_changes_top_k(model, tokens)
    with torch.no_grad():
        logits = model(tokens).logits.float().numpy()
    tmp = OUT / "_tmp"
    model.save_pretrained(tmp)
    state = released_layout(load_file(tmp / "model.safetensors"), config)
    target = OUT / "kimi_linear"
    target.mkdir(parents=True)
    save_file(state, target / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(tmp / "config.json", target / "config.json")
    reloaded = KimiLinearForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        again = reloaded(tokens).logits.float().numpy()
    assert np.array_equal(again, logits), "transformers must read the released layout back"
    bf16 = KimiLinearForCausalLM.from_pretrained(target, dtype=torch.bfloat16)
    shutil.rmtree(tmp)
    bf16.save_pretrained(tmp)
    ref = released_layout(load_file(tmp / "model.safetensors"), config)
    (OUT / "kimi_linear_bf16.json").write_text(json.dumps(
        {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in sorted(ref.items())},
        indent=0))
    shutil.rmtree(tmp)
    return state, json.loads((target / "config.json").read_text()), tokens.numpy(), logits


def k3_config(kl: dict) -> dict:
    full = [i + 1 for i, t in enumerate(LAYERS) if t == "full_attention"]
    text = {
        "model_type": "kimi_linear", "vocab_size": VOCAB, "hidden_size": D,
        "num_hidden_layers": len(LAYERS), "intermediate_size": 48, "hidden_act": "situ",
        "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 16,
        "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "mla_use_nope": True, "mla_use_output_gate": True, "rms_norm_eps": kl["rms_norm_eps"],
        "linear_attn_config": {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                               "full_attn_layers": full,
                               "kda_layers": [i for i in range(1, len(LAYERS) + 1)
                                              if i not in full]},
        "attn_res_block_size": 1, "num_experts": EXPERTS, "num_experts_per_token": TOP_K,
        "moe_intermediate_size": K3_INTER, "routed_expert_hidden_size": K3_LATENT,
        "latent_moe_use_norm": True, "num_shared_experts": 1, "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_expert_group": 1,
        "topk_group": 1, "moe_renormalize": True, "tie_word_embeddings": False,
    }
    quant = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
             "config_groups": {"group_0": {"targets": ["Linear"], **{
                 k: (v.model_dump() if hasattr(v, "model_dump") else v)
                 for k, v in MXFP4A16.items()}}},
             "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
                        "re:.*mlp\\.(gate|up|down)_proj", "lm_head"]}
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
            "text_config": text, "quantization_config": quant}


def k3_tensors(kl_state: dict, gen: torch.Generator) -> dict:
    """The Kimi Linear tensors that fit K3's shapes, plus K3's own ones (random)."""
    bf = torch.bfloat16
    rand = lambda *s: (0.05 * torch.randn(s, generator=gen)).to(bf)
    ones = lambda n: (1.0 + 0.2 * torch.randn(n, generator=gen)).to(bf)
    out = {}
    for k, v in kl_state.items():
        mla_q = k.endswith("self_attn.q_proj.weight") and LAYERS[int(k.split(".")[2])] == \
            "full_attention"
        if ".experts." in k or "g_a_proj" in k or "g_b_proj" in k or mla_q:
            continue
        keep32 = k.endswith(("conv1d.weight", "dt_bias", "o_norm.weight",
                             "e_score_correction_bias"))
        out["language_model." + k] = v.float() if keep32 else v.to(bf)
    for i, kind in enumerate(LAYERS):
        p = f"language_model.model.layers.{i}."
        a = p + "self_attn.A_log"
        if kind == "linear_attention":
            out[a] = torch.cat([out[a].float().reshape(-1), torch.zeros(A_LOG_PAD - 2)])
            out[p + "self_attn.g_proj.weight"] = rand(32, D)
        else:
            out[p + "self_attn.q_a_proj.weight"] = rand(16, D)
            out[p + "self_attn.q_a_layernorm.weight"] = ones(16)
            out[p + "self_attn.q_b_proj.weight"] = rand(2 * 24, 16)
            out[p + "self_attn.g_proj.weight"] = rand(2 * 16, D)
        for name in ("self_attention_res", "mlp_res"):
            out[p + f"{name}_norm.weight"] = ones(D)
            out[p + f"{name}_proj.weight"] = rand(1, D) * 20
        if i == 0:
            continue
        m = p + "block_sparse_moe."
        for name in ("gate_proj", "up_proj"):
            out[m + f"shared_experts.{name}.weight"] = rand(K3_INTER, D)
        out[m + "shared_experts.down_proj.weight"] = rand(D, K3_INTER)
        out[m + "routed_expert_down_proj.weight"] = rand(K3_LATENT, D)
        out[m + "routed_expert_up_proj.weight"] = rand(D, K3_LATENT)
        out[m + "routed_expert_norm.weight"] = ones(K3_LATENT)
        for e in range(EXPERTS):
            for w, (rows, cols) in (("w1", (K3_INTER, K3_LATENT)), ("w3", (K3_INTER, K3_LATENT)),
                                    ("w2", (K3_LATENT, K3_INTER))):
                q = f"{m}experts.{e}.{w}."
                out[q + "weight_packed"] = torch.randint(0, 256, (rows, cols // 2),
                                                         generator=gen, dtype=torch.uint8)
                out[q + "weight_scale"] = torch.randint(118, 125, (rows, cols // 32),
                                                        generator=gen, dtype=torch.uint8)
    p = "language_model.model."
    out[p + "output_attn_res_norm.weight"] = ones(D)
    out[p + "output_attn_res_proj.weight"] = rand(1, D) * 20
    out["vision_tower.patch_embed.weight"] = rand(4, 4)  # ignored by a text-only import
    return out


def write_k3(tensors: dict, config: dict) -> None:
    target = OUT / "kimi_k3"
    target.mkdir(parents=True)
    names = sorted(tensors)
    halves = [names[:len(names) // 2], names[len(names) // 2:]]
    files = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
    for f, part in zip(files, halves):
        save_file({k: tensors[k].contiguous() for k in part}, target / f, metadata={"format": "pt"})
    weight_map = {k: f for f, part in zip(files, halves) for k in part}
    (target / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}, indent=0))
    (target / "config.json").write_text(json.dumps(config, indent=1))


def mxfp4_reference(tensors: dict, layer: int) -> dict:
    """compressed-tensors' own decoding of layer ``layer``'s packed experts."""
    scheme = QuantizationScheme(targets=["Linear"], **MXFP4A16)
    out = {}
    for k in sorted(tensors):
        if k.startswith(f"language_model.model.layers.{layer}.") and k.endswith("weight_packed"):
            base = k[:-len("_packed")]
            sd = MXFP4PackedCompressor.decompress(
                {"weight_packed": tensors[k], "weight_scale": tensors[base + "_scale"]}, scheme)
            out["mxfp4/" + base] = sd["weight"].float().numpy()
    return out


def attnres_reference(tensors: dict, eps: float, gen: torch.Generator) -> dict:
    """The released mix: ``softmax_i(rmsnorm_noweight(v_i) . (norm.weight * proj.weight)) v_i``."""
    p = "language_model.model.layers.2.mlp_res"
    norm_w, proj_w = tensors[p + "_norm.weight"].float(), tensors[p + "_proj.weight"].float()
    v = torch.randn(4, 2, 5, D, generator=gen) * torch.tensor([1.0, 3.0, 0.5, 2.0])[:, None,
                                                                                   None, None]
    unit = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    scores = (unit * (norm_w * proj_w[0])).sum(-1)
    mix = (torch.softmax(scores, dim=0)[..., None] * v).sum(0)
    return {"attnres/sources": v.numpy(), "attnres/mix": mix.numpy()}


def check_export(directory: str) -> None:
    expected = np.load(OUT / "expected.npz")
    model, info = KimiLinearForCausalLM.from_pretrained(directory, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, problems
    with torch.no_grad():
        logits = model.float()(torch.tensor(expected["tokens"])).logits.numpy()
    ref = expected["logits"]
    err = np.sqrt(np.mean((logits - ref) ** 2)) / np.sqrt(np.mean(ref ** 2))
    print(json.dumps({"directory": directory, "rel_rms_vs_fixture_logits": float(err)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check-export", metavar="DIR")
    args = parser.parse_args()
    if args.check_export:
        check_export(args.check_export)
        return
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    gen = torch.Generator().manual_seed(20)
    state, kl_config, tokens, logits = write_kimi_linear(gen)
    tensors = k3_tensors(state, gen)
    config = k3_config(kl_config)
    write_k3(tensors, config)
    np.savez_compressed(OUT / "expected.npz", tokens=tokens, logits=logits,
                        **mxfp4_reference(tensors, 1),
                        **attnres_reference(tensors, config["text_config"]["rms_norm_eps"], gen))
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"wrote {OUT} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
