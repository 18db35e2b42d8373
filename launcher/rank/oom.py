"""Out of memory on a rank's device: say which settings would make the step fit, not only TensorFlow's trace.

TensorFlow reports a failed allocation as `tf.errors.ResourceExhaustedError` ("OOM when allocating
tensor with shape[...]"), after dumping its allocator's state, and a convolution whose workspace fits
nowhere as `NotFoundError` ("No algorithm worked!"; lms_core.tf.allocations.out_of_memory says which
errors mean the device is full). The worker turns that error, from
training or from the LMS set-up (which runs steps to check or profile the rewrite), into this short
message naming the allocation, the rank, the device, and the LMS and batch settings to change, and
ends the rank with `OUT_OF_MEMORY_STATUS`.
"""
from __future__ import annotations

from launcher.config import Recipe

OUT_OF_MEMORY_STATUS = 1


def out_of_memory_advice(recipe: Recipe, rank: int, device: str, error_text: str) -> str:
    """The message for an OOM on `device` of `rank` under `recipe`; `error_text` is TensorFlow's."""
    lms, batch = recipe.lms, recipe.train.batch_size
    # TensorFlow's sentence is "OOM when allocating tensor with shape[...] and type ... on DEVICE by
    # allocator ...", inside a longer text (the traced function's name before it, the node after).
    start = error_text.find("OOM when allocating")
    text = error_text[start:] if start >= 0 else error_text.strip()
    allocation = text.splitlines()[0].strip() if text else "(no message)"
    lines = [f"rank {rank} ran out of memory on {device} (train.batch_size={batch}, "
             f"lms.enabled={'true' if lms.enabled else 'false'}" + (f", lms.mode={lms.mode}" if lms.enabled else "")
             + ")",
             f"  TensorFlow: {allocation}"]
    if not lms.enabled:
        lines.append("  Large Model Support can make it fit by parking activations in host memory: "
                     "--set lms.enabled=true (lms.mode: auto tunes what to swap for this device's memory).")
    elif lms.mode == "auto":
        budget = lms.device_memory or "the device's total memory"
        lines.append(f"  LMS is on and auto-tuned for {budget} x lms.memory_ratio={lms.memory_ratio}: plan for "
                     f"less, e.g. --set lms.device_memory=<a smaller size> or a lower lms.memory_ratio, so the "
                     f"tuner swaps more (memory that TensorFlow, cuDNN or other processes take is not in its plan).")
    else:
        lines.append(f"  LMS is on with lms.mode=manual: swap more with a lower lms.swapout_threshold (now "
                     f"{lms.swapout_threshold}) or lms.min_tensor_bytes (now {lms.min_tensor_bytes}), or let it "
                     f"tune itself with lms.mode=auto and lms.device_memory=<this device's memory>.")
    lines.append(f"  Or lower train.batch_size (now {batch}). `lms-launch plan RECIPE --device-memory SIZE` "
                 f"estimates the peak of a setting without a GPU.")
    return "\n".join(lines)
