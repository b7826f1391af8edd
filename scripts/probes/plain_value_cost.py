"""What comparing the plain values a step reads costs each replay (`frozen/plain_roots.py`):
a 12-block GPT written as a user writes one (its forwards read sizes and flags on
themselves), a config object read by the step. CPU only:

    python3 scripts/probes/plain_value_cost.py
"""

import time
import types

import torch
import torch.nn.functional as F
from torch import nn

from ddpgraph.frozen.outside_state import OutsideState
from ddpgraph.frozen.plain_roots import PlainRoots


class Attn(nn.Module):
    def __init__(s, d, h):
        super().__init__()
        s.qkv = nn.Linear(d, 3 * d)
        s.proj = nn.Linear(d, d)
        s.n_head = h
        s.n_embd = d
        s.dropout = 0.1
        s.flash = True

    def forward(s, x):
        B, T, C = x.size()
        q, k, v = s.qkv(x).split(s.n_embd, dim=2)
        q = q.view(B, T, s.n_head, C // s.n_head)
        if s.flash:
            y = F.scaled_dot_product_attention(
                q, k.view_as(q), v.view_as(q), dropout_p=s.dropout if s.training else 0
            )
        return s.proj(y.reshape(B, T, C))


class Block(nn.Module):
    def __init__(s, d, h):
        super().__init__()
        s.ln1 = nn.LayerNorm(d)
        s.attn = Attn(d, h)
        s.ln2 = nn.LayerNorm(d)
        s.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(s, x):
        x = x + s.attn(s.ln1(x))
        return x + s.mlp(s.ln2(x))


class GPT(nn.Module):
    def __init__(s, n=12):
        super().__init__()
        s.config = types.SimpleNamespace(block_size=64, vocab=100)
        s.wte = nn.Embedding(100, 64)
        s.blocks = nn.ModuleList([Block(64, 4) for _ in range(n)])

    def forward(s, idx):
        assert idx.size(1) <= s.config.block_size
        x = s.wte(idx)
        for b in s.blocks:
            x = b(x)
        return x


m = GPT()
opt = torch.optim.AdamW(m.parameters())
cfg = types.SimpleNamespace(scale=1.0, clip=1.0)


def step(x, y):
    opt.zero_grad()
    loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten()) * cfg.scale
    loss.backward()
    opt.step()
    return loss.detach()


st = OutsideState(step, m)
pr = PlainRoots(st, list(m.modules()))
print("kept", len(pr.names), pr.names[:6])
n = 2000
t = time.perf_counter()
for _ in range(n):
    pr.changed("x")
print("us per check", (time.perf_counter() - t) / n * 1e6)
