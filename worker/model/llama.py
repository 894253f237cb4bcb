"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2/2.5 (QKV bias), Qwen3 (q/k RMSNorm).

``forward`` takes flat tokens of every request in the batch and an attention backend that was
planned for them; it has no Python control flow that depends on tensor values, so a graph
runner can capture it.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.attention.base import AttentionBackend, AttentionShape, Rope
from worker.model.arch import ModelArch
from worker.model.kernels import Kernels
from worker.model.linear import ColumnParallelLinear, RowParallelLinear, Source, VocabParallelEmbedding, qkv_sources
from worker.model.parallel import SINGLE, TensorParallel
from worker.model.rotary import cos_sin_cache
from worker.model.torch_kernels import TorchKernels
from worker.model.weights import SafetensorsCheckpoint


class RMSNorm(nn.Module):
    def __init__(self, name: str, size: int, eps: float, dtype: torch.dtype, kernels: Kernels) -> None:
        super().__init__()
        self.name, self.size, self.eps, self.kernels = name, size, eps, kernels
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

    def load(self, ckpt: SafetensorsCheckpoint) -> None:
        self.weight.data.copy_(ckpt.read(self.name, (self.size,)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer: int, tp: TensorParallel, dtype: torch.dtype, kernels: Kernels) -> None:
        super().__init__()
        prefix = f"model.layers.{layer}.self_attn"
        sources, self.q_heads, self.kv_heads = qkv_sources(
            prefix, arch.num_heads, arch.num_kv_heads, arch.head_dim, tp)
        self.layer, self.head_dim, self.kernels = layer, arch.head_dim, kernels
        self.q_size, self.kv_size = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(arch.hidden_size, sources, arch.qkv_bias, dtype)
        self.o_proj = RowParallelLinear(f"{prefix}.o_proj", arch.q_size, arch.hidden_size, tp, dtype)
        self.q_norm = self.k_norm = None
        if arch.qk_norm:
            self.q_norm = RMSNorm(f"{prefix}.q_norm.weight", arch.head_dim, arch.rms_norm_eps, dtype, kernels)
            self.k_norm = RMSNorm(f"{prefix}.k_norm.weight", arch.head_dim, arch.rms_norm_eps, dtype, kernels)

    def forward(self, x: torch.Tensor, rope: Rope, attn: AttentionBackend) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        # q, k and v stay strided views of qkv (rows qkv_size apart): RoPE, the KV write and the
        # attention backends take row strides, so no copy kernels run between the projection and
        # attention. The backend rotates q and k (in one kernel with the KV write where it can).
        out = attn.run_with_rope(self.layer, rope, q, k, v)
        return self.o_proj(out.reshape(qkv.shape[0], self.q_size))


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, layer: int, tp: TensorParallel, dtype: torch.dtype, kernels: Kernels) -> None:
        super().__init__()
        prefix = f"model.layers.{layer}.mlp"
        start, local = tp.shard(arch.intermediate_size, "intermediate_size")
        inter = arch.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            arch.hidden_size,
            [Source(f"{prefix}.gate_proj", inter, start, local), Source(f"{prefix}.up_proj", inter, start, local)],
            False, dtype)
        self.down_proj = RowParallelLinear(f"{prefix}.down_proj", inter, arch.hidden_size, tp, dtype)
        self.kernels = kernels

    def forward(self, x: torch.Tensor, chunk_tokens: int | None = None) -> torch.Tensor:
        """``down(silu(gate) * up)`` of ``x``. With ``chunk_tokens``, row chunks of at most that many
        tokens go through gate/up, SiLU and the down projection one after another into one output,
        so the layer's largest activations (gate/up and SiLU, 3x the intermediate size a token) are a
        chunk's; the TP all-reduce runs once, over the whole output."""
        if chunk_tokens is None or x.shape[0] <= chunk_tokens:
            return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))
        out = x.new_empty((x.shape[0], self.down_proj.out_local))
        for start in range(0, x.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            self.down_proj.partial_into(self.kernels.silu_and_mul(self.gate_up_proj(x[rows])), out[rows])
        return self.down_proj.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    """One decoder layer: RMSNorm, attention, residual add + RMSNorm, MLP."""

    def __init__(self, arch: ModelArch, layer: int, tp: TensorParallel, dtype: torch.dtype, kernels: Kernels) -> None:
        super().__init__()
        prefix = f"model.layers.{layer}"
        self.self_attn = Attention(arch, layer, tp, dtype, kernels)
        self.mlp = MLP(arch, layer, tp, dtype, kernels)
        eps = arch.rms_norm_eps
        self.input_layernorm = RMSNorm(f"{prefix}.input_layernorm.weight", arch.hidden_size, eps, dtype, kernels)
        self.post_attention_layernorm = RMSNorm(
            f"{prefix}.post_attention_layernorm.weight", arch.hidden_size, eps, dtype, kernels)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, attn: AttentionBackend,
                mlp_chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(x, rope, attn)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x, mlp_chunk_tokens), residual


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM on one tensor-parallel rank.

    Build with :func:`worker.model.loader.load_model`; ``forward`` returns final hidden states
    (tokens, hidden) and ``compute_logits`` turns selected rows into float32 logits.
    """

    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, kernels: Kernels | None = None, max_positions: int | None = None) -> None:
        super().__init__()
        kernels = kernels or TorchKernels()
        self.arch, self.tp, self.kernels = arch, tp, kernels
        with torch.device(device):
            self.embed_tokens = VocabParallelEmbedding(
                "model.embed_tokens.weight", arch.vocab_size, arch.hidden_size, tp, dtype)
            self.layers = nn.ModuleList(DecoderLayer(arch, i, tp, dtype, kernels) for i in range(arch.num_layers))
            self.norm = RMSNorm("model.norm.weight", arch.hidden_size, arch.rms_norm_eps, dtype, kernels)
            self.lm_head = self.embed_tokens if arch.tie_word_embeddings else VocabParallelEmbedding(
                "lm_head.weight", arch.vocab_size, arch.hidden_size, tp, dtype)
        self.register_buffer(
            "cos_sin_cache",
            cos_sin_cache(arch.head_dim, arch.rope_theta, arch.rope_scaling,
                          max_positions or arch.max_position_embeddings, device),
            persistent=False)
        first = self.layers[0].self_attn
        self.attention_shape = AttentionShape(first.q_heads, first.kv_heads, arch.head_dim, arch.head_dim ** -0.5)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def load(self, ckpt: SafetensorsCheckpoint) -> None:
        """Fill every parameter from ``ckpt`` (only this rank's shards are read)."""
        for module in self.modules():
            if module is not self and hasattr(module, "load"):
                module.load(ckpt)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                mlp_chunk_tokens: int | None = None) -> torch.Tensor:
        """Final hidden states of ``input_ids`` at ``positions``; ``mlp_chunk_tokens``: see :meth:`MLP.forward`."""
        x = self.embed_tokens(input_ids)
        residual = None
        rope = Rope(positions, self.cos_sin_cache, self.arch.head_dim, self.kernels.apply_rope)
        for layer in self.layers:
            x, residual = layer(x, residual, rope, attn, mlp_chunk_tokens)
        x, _ = self.norm.add_and_norm(x, residual)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """Logits of ``hidden``'s rows in ``dtype`` (None: the model's dtype; see ``VocabParallelEmbedding.logits``)."""
        return self.lm_head.logits(hidden, dtype)
