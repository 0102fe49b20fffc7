"""Write a verl FSDP2 checkpoint of an HF model on CPU (gloo, world size 1), as verl's trainer does.

    python tests/stages/fsdp_checkpoint.py HF_DIR OUT_ACTOR_DIR STEP
Weights are shifted by +0.01 first; the expected state dict is saved next to the actor dir.
"""

import os
import sys

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

import grpo.model  # noqa: F401  (registers CosyVoiceLMForCausalLM, as verl's external_lib does)


def main(hf_dir: str, out: str, step: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    os.makedirs(out, exist_ok=True)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(os.path.dirname(out), "expected.pt"))
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    manager = FSDPCheckpointManager(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5), lr_scheduler=None,
        processing_class=AutoTokenizer.from_pretrained(hf_dir),
        checkpoint_config=OmegaConf.create({"save_contents": ["model", "optimizer", "extra"],
                                            "load_contents": ["model"]}))
    manager.save_checkpoint(out, global_step=step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
