"""Memory traffic of Gated DeltaNet rollback per verify cycle: tape vs a state per step.

    python examples/tape_traffic.py

Computed from the shapes of the Qwen3.5-9B text model (hidden 4096, 32 layers of which 24 are
Gated DeltaNet, 16 key heads and 32 value heads of dimension 128, conv kernel 4: the defaults
of transformers' Qwen3_5TextConfig), bf16 activations, float32 recurrent state.
"""

GDN_LAYERS = 24
HK, HV, DK, DV = 16, 32, 128, 128
CONV_DIM = 2 * HK * DK + HV * DV
ACT, F32 = 2, 4  # bytes: bf16 activations, float32 state and tape
MiB = 1 << 20

state = HV * DV * DK * F32  # one layer's recurrent state
per_step_tape = HV * DV * F32 + HV * F32  # delta [Hv, Dv] and g [Hv]; k is the verify pass's own input
per_step_k = HK * DK * ACT  # read back by the replay
conv_rows = CONV_DIM * ACT  # qkv rows kept for the conv state (same in both designs)


def per_layer(T: int, accepted: int):
    """Bytes moved for one layer and one cycle: (tape design, state-per-step design)."""
    # Both designs read the starting state and write the final state in the verify pass.
    verify_common = 2 * state + T * conv_rows
    tape = verify_common + T * per_step_tape
    snapshots = verify_common + (T - 1) * state  # every intermediate state written out
    if accepted + 1 < T:  # something rejected: roll back
        keep = accepted + 1
        tape += 2 * state + keep * (per_step_tape + per_step_k)  # read start, replay, write
        # State per step: the kept snapshot is used in place, no traffic (its best case).
    return tape, snapshots


print("| block T | accepted | tape design | state per step | ratio |")
print("|---:|---:|---:|---:|---:|")
for T in (4, 8, 16):
    for accepted in (0, T // 2, T - 1):
        tape, snapshots = (GDN_LAYERS * x for x in per_layer(T, accepted))
        print(f"| {T} | {accepted} | {tape / MiB:.1f} MiB | {snapshots / MiB:.1f} MiB | {snapshots / tape:.2f}x |")
print(f"\nOne layer's state: {state / MiB:.1f} MiB; tape per step and layer: {per_step_tape / 1024:.1f} KiB.")
