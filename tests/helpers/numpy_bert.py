"""A reference BERT encoder in NumPy (float64), written from the BERT equations.

Independent of `recompute.bert4keras.converter`: it reads the Hugging Face weights
straight from ``model.safetensors`` (HF names) and ``config.json``, and
computes, for token ids ``x``, segment ids ``s`` and a key mask ``m`` (1 for a
real token, 0 for padding)::

    h = LN(W_tok[x] + W_pos[0..T-1] + W_seg[s])
    for each layer:
        q, k, v = h Wq^T + bq, h Wk^T + bk, h Wv^T + bv          (split in heads)
        a = softmax(q k^T / sqrt(d_head) + (m - 1) * inf) v       (padded keys get 0)
        h = LN(h + a Wo^T + bo)
        h = LN(h + gelu(h W1^T + b1) W2^T + b2)                   (erf GELU)
    pooled = tanh(h[:, 0] Wp^T + bp)

with ``LN(z) = gamma * (z - mean) / sqrt(var + eps) + beta`` over the last
axis and ``eps`` from ``config.json``.
"""

import json
import math
import os
import zipfile

import numpy as np
import safetensors.numpy

_erf = np.vectorize(math.erf, otypes=[np.float64])


def gelu_erf(x):
    """GELU with the exact Gaussian CDF: x * (1 + erf(x / sqrt 2)) / 2."""
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def gelu_tanh(x):
    """GELU with the tanh approximation."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


ACTIVATIONS = {
    "gelu": gelu_erf,
    "gelu_new": gelu_tanh,
    "relu": lambda x: np.maximum(x, 0.0),
}


def _read(src, name):
    """Bytes of `name` in the directory or zip `src` (zip: shallowest match)."""
    if os.path.isdir(src):
        with open(os.path.join(src, name), "rb") as f:
            return f.read()
    with zipfile.ZipFile(src) as zf:
        matches = [n for n in zf.namelist() if n.split("/")[-1] == name]
        return zf.read(min(matches, key=lambda n: n.count("/")))


def load_hf(src):
    """(config dict, {HF name: float64 array}) of the HF BERT in the directory or zip `src`.

    Names lose a leading ``bert.``; old ``LayerNorm.gamma/beta`` become
    ``LayerNorm.weight/bias``.
    """
    config = json.loads(_read(src, "config.json").decode("utf-8"))
    raw = safetensors.numpy.load(_read(src, "model.safetensors"))
    weights = {}
    for name, value in raw.items():
        if name.startswith("bert."):
            name = name[5:]
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        weights[name] = np.asarray(value, dtype=np.float64)
    return config, weights


class NumpyBert:
    """BERT encoder forward pass over HF-named weights.

    `NumpyBert(config, weights)` or `NumpyBert.from_hf(src)`; calling it with
    token ids ``[batch, time]`` returns ``(last hidden states [batch, time,
    hidden], pooled [batch, hidden] or None without a pooler)``.
    """

    def __init__(self, config, weights):
        self.config = config
        self.w = weights
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        self.heads = int(config["num_attention_heads"])
        self.layers = int(config["num_hidden_layers"])
        self.act = ACTIVATIONS[config.get("hidden_act", "gelu")]

    @classmethod
    def from_hf(cls, src):
        return cls(*load_hf(src))

    def _linear(self, x, name):
        """x W^T + b, with W [out, in] as HF stores it (2-D matmul: BLAS)."""
        weight = self.w[name + ".weight"]
        y = np.dot(x.reshape(-1, x.shape[-1]), weight.T) + self.w[name + ".bias"]
        return y.reshape(x.shape[:-1] + (weight.shape[0],))

    def _norm(self, x, name):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return self.w[name + ".weight"] * (x - mean) / np.sqrt(var + self.eps) + self.w[name + ".bias"]

    def _attention(self, x, mask, prefix):
        batch, time, hidden = x.shape
        d = hidden // self.heads

        def split(t):
            return t.reshape(batch, time, self.heads, d).transpose(0, 2, 1, 3)

        q = split(self._linear(x, prefix + "self.query"))
        k = split(self._linear(x, prefix + "self.key"))
        v = split(self._linear(x, prefix + "self.value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d)
        scores = np.where(mask[:, None, None, :] > 0, scores, -np.inf)
        scores = scores - scores.max(-1, keepdims=True)
        p = np.exp(scores)
        p = p / p.sum(-1, keepdims=True)
        context = (p @ v).transpose(0, 2, 1, 3).reshape(batch, time, hidden)
        return self._linear(context, prefix + "output.dense")

    def __call__(self, token_ids, segment_ids=None, attention_mask=None):
        token_ids = np.asarray(token_ids)
        batch, time = token_ids.shape
        if segment_ids is None:
            segment_ids = np.zeros_like(token_ids)
        if attention_mask is None:
            attention_mask = np.ones_like(token_ids)
        mask = np.asarray(attention_mask)
        x = (
            self.w["embeddings.word_embeddings.weight"][token_ids]
            + self.w["embeddings.position_embeddings.weight"][np.arange(time)][None]
            + self.w["embeddings.token_type_embeddings.weight"][np.asarray(segment_ids)]
        )
        x = self._norm(x, "embeddings.LayerNorm")
        for i in range(self.layers):
            p = f"encoder.layer.{i}."
            x = self._norm(x + self._attention(x, mask, p + "attention."), p + "attention.output.LayerNorm")
            ffn = self._linear(self.act(self._linear(x, p + "intermediate.dense")), p + "output.dense")
            x = self._norm(x + ffn, p + "output.LayerNorm")
        pooled = None
        if "pooler.dense.weight" in self.w:
            pooled = np.tanh(self._linear(x[:, 0], "pooler.dense"))
        return x, pooled
