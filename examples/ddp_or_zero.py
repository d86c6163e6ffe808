"""DDP or ZeRO for a real model shape: the memory plan of a Llama 3.2 1B-shaped model, on 8 ranks of 80 GiB and 24 GiB.

    python examples/ddp_or_zero.py [--layers-measured 1 2] [--sequence 1024] [--batch 1]

No download and no 1B-parameter model in memory: the full model is built on the ``meta`` device, which gives its
parameters, gradients, DDP buckets and AdamW state exactly (shapes and dtypes); the activations and the peak of a
forward and backward are measured on real models of the same width with 1 and 2 decoder layers (a real forward,
counted with saved-tensor hooks; a real backward, counted tensor by tensor) and extended to the full depth by the
plan's arithmetic (figure = a + b x layers; the check on a tiny config below shows how well that line predicts a
deeper model). The optimizer step's temporaries are not measured on the ``meta`` device (they are 0 here).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_ddp_plus.memory.plan import measure_model, plan_layouts

LLAMA_3_2_1B = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


#: the figures that grow with depth: activations and the forward-and-backward peak, without and with checkpointing,
#: and the optimizer step's temporaries (a foreach step's are the size of every parameter, a model on the ``meta``
#: device has none to step)
DEPTH_FIGURES = (
    "activations",
    "activations_checkpointed",
    "backward_peak",
    "backward_peak_checkpointed",
    "optimizer_temporaries",
)
#: the job's device: the plan reproduces its optimizer implementation (foreach) and allocator rounding on this CPU
DEVICE_TYPE = "cuda"


def activations(shape: dict, layers: int, batch: int, sequence: int) -> dict[str, int]:
    """Saved-tensor bytes of one training forward and the peak of one forward and backward (and both with
    activation checkpointing), and the AdamW step's temporaries, of a real model."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**shape, "num_hidden_layers": layers}))
    ids = torch.randint(0, shape["vocab_size"], (batch, sequence))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss = lambda: model(input_ids=ids, labels=ids).loss
    figures = measure_model(model, optimizer, loss, inputs=ids, device_type=DEVICE_TYPE)
    return {name: getattr(figures, name) or 0 for name in DEPTH_FIGURES}


def extended(shape: dict, measured: tuple[int, int], batch: int, sequence: int, layers: int) -> dict[str, int]:
    """The figures at ``layers``: activations and the optimizer step's temporaries on the line through the
    ``measured`` depths; a forward-and-backward peak as the deeper one's, plus the activations the added layers save.

    A peak is not a line: it can sit where depth does not reach (Llama 3.2 1B's is the same at 1 and 2 layers, at the
    tied embedding's gradient), and a line through it would fall below the activations of a deeper model. Each added
    layer holds at most its saved tensors more at any moment (its own temporaries are those of the layers measured),
    so this is the most the deeper model's peak can be."""
    (depth_a, depth_b) = measured
    low, high = activations(shape, depth_a, batch, sequence), activations(shape, depth_b, batch, sequence)
    slope = {name: (high[name] - low[name]) / (depth_b - depth_a) for name in DEPTH_FIGURES}
    figures = {name: int(low[name] + slope[name] * (layers - depth_a)) for name in DEPTH_FIGURES}
    for peak, saved in (("backward_peak", "activations"), ("backward_peak_checkpointed", "activations_checkpointed")):
        figures[peak] = high[peak] + figures[saved] - high[saved]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers-measured", nargs=2, type=int, default=[1, 2])
    parser.add_argument("--sequence", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape instead of Llama 3.2 1B (a quick check)")
    args = parser.parse_args()

    tiny = {**LLAMA_3_2_1B, "vocab_size": 1000, "hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4,
            "num_key_value_heads": 2}  # fmt: skip
    predicted, real = extended(tiny, (1, 2), 2, 256, 6), activations(tiny, 6, 2, 256)
    for name in ("activations", "backward_peak", "optimizer_temporaries"):
        print(f"the line checked on a tiny config: {name} of 6 layers predicted {predicted[name]} B, measured "
              f"{real[name]} B ({100 * (predicted[name] - real[name]) / real[name]:+.1f} %)")  # fmt: skip
    shape = tiny if args.tiny else LLAMA_3_2_1B

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**shape))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    figures = measure_model(model, optimizer, None, device_type=DEVICE_TYPE)
    depth = extended(shape, tuple(args.layers_measured), args.batch, args.sequence, shape["num_hidden_layers"])
    figures = dataclasses.replace(figures, **depth)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"\n{'tiny' if args.tiny else 'Llama 3.2 1B'} shape: {parameters / 1e9:.2f} B parameters (fp32), AdamW, micro-batch {args.batch} x "
          f"{args.sequence} tokens")  # fmt: skip
    for device in (80 * 2**30, 24 * 2**30):
        print()
        print(plan_layouts(figures, args.world_size, device).render())


if __name__ == "__main__":
    main()
