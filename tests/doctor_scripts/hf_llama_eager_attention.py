"""A small Llama from transformers, built from a config with the eager attention
implementation, trained with `ddpgraph.capture_step`.

    torchrun --nproc_per_node=2 tests/doctor_scripts/hf_llama_eager_attention.py
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import ddpgraph


class CausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        config = LlamaConfig(
            vocab_size=2048,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            attn_implementation="eager",
        )
        self.lm = LlamaForCausalLM(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids).logits  # doctor: HOST_SYNC_IN_CAPTURE


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    model = ddpgraph.prepare_ddp(CausalLM().cuda(), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

    def train_step(tokens: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.detach()

    step = ddpgraph.capture_step(train_step, model=model, optimizer=opt)
    for _ in range(20):
        loss = step(torch.randint(0, 2048, (4, 65), device="cuda"))
    if dist.get_rank() == 0:
        print(f"loss {loss.item():.3f}, step {step.state.value}, reason {step.reason}")
    step.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
