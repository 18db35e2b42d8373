"""Is the unpacked bundle's TensorFlow working on this machine's GPU? Prints what it found and exits 0 or 1.

Run by `unpack.py` with the bundle's paths set (or by hand: `source DIR/env.sh && python3 DIR/check.py`).
It prints TensorFlow's GPU list, the CUDA and cuDNN versions TensorFlow was built with and the ones it
loaded, the file each CUDA library was loaded from (the bundle's, its empty stand-ins, or the
machine's), and a convolution (forward and backward) and a matrix product on the GPU compared with
the CPU's. The CPU convolution is itself compared with a NumPy reference. `--cpu-only` skips the GPU
(for checking a bundle on a machine without one). The last line is `RESULT {json}`, which
`unpack.py` reads.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

# The libraries TensorFlow opens when it registers a GPU (and two that the real cuFFT/cuSOLVER/cuSPARSE
# would pull in): reported with the file each came from.
WATCHED = ("libcudart.so", "libcublas.so", "libcublasLt.so", "libcufft.so", "libcusolver.so", "libcusparse.so",
           "libcudnn.so", "libcudnn_", "libnvJitLink.so", "libnvrtc.so", "libcupti.so", "libnccl.so")
# float32 on both sides with TensorFloat-32 off: the GPU's result differs from the CPU's by rounding in a
# different summation order, about 1e-6 of the output's scale for 576-term sums; 1e-4 leaves room for
# cuDNN's Winograd and FFT algorithms and still fails on any real fault (a wrong result is off by O(1)).
TOLERANCE = 1e-4
GPU_OPS = ("conv", "conv_backward", "matmul")


def loaded_libraries() -> dict[str, str]:
    """soname-ish file name -> path, for the watched libraries mapped into this process."""
    found: dict[str, str] = {}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(None, 5)
                if len(fields) < 6:
                    continue
                path = fields[5].strip()
                name = os.path.basename(path)
                if name.startswith(WATCHED) and name not in found:
                    found[name] = path
    except OSError:
        pass
    return dict(sorted(found.items()))


def _version_call(path: str, symbol: str, by_pointer: bool) -> int | None:
    try:
        lib = ctypes.CDLL(path)
        fn = getattr(lib, symbol)
    except (OSError, AttributeError):
        return None
    if by_pointer:
        out = ctypes.c_int(0)
        fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
        return out.value if fn(ctypes.byref(out)) == 0 else None
    fn.restype = ctypes.c_size_t
    return int(fn())


def _cuda_version(v: int | None) -> str | None:
    if v is None or v == 0:  # cudaDriverGetVersion gives 0 where no driver is installed
        return None
    return f"{v // 1000}.{v % 1000 // 10}"


def _cudnn_version(v: int | None) -> str | None:
    # cuDNN 9 encodes major*10000 + minor*100 + patch (cuDNN 8: major*1000 + minor*100 + patch)
    if v is None:
        return None
    return f"{v // 10000}.{v % 10000 // 100}.{v % 100}" if v >= 90000 else f"{v // 1000}.{v % 1000 // 100}.{v % 100}"


def runtime_versions(libs: dict[str, str]) -> dict:
    out = {}
    cudnn = libs.get("libcudnn.so.9") or next((p for n, p in libs.items() if n.startswith("libcudnn.so")), None)
    if cudnn:
        out["cudnn"] = _cudnn_version(_version_call(cudnn, "cudnnGetVersion", False))
        out["cudnn_built_for_cuda"] = _cuda_version(_version_call(cudnn, "cudnnGetCudartVersion", False))
    cudart = next((p for n, p in libs.items() if n.startswith("libcudart.so")), None)
    if cudart:
        out["cudart"] = _cuda_version(_version_call(cudart, "cudaRuntimeGetVersion", True))
        out["driver_supports_cuda"] = _cuda_version(_version_call(cudart, "cudaDriverGetVersion", True))
    return out


def numpy_conv_same(x, w):
    """NHWC x HWIO, stride 1, 'SAME' padding, written independently of TensorFlow."""
    import numpy as np

    kh, kw = w.shape[:2]
    pad = ((0, 0), (kh // 2, kh - 1 - kh // 2), (kw // 2, kw - 1 - kw // 2), (0, 0))
    xp = np.pad(x.astype(np.float64), pad)
    h, wd = x.shape[1:3]
    out = np.zeros(x.shape[:3] + (w.shape[3],))
    for i in range(kh):
        for j in range(kw):
            out += np.tensordot(xp[:, i:i + h, j:j + wd, :], w[i, j].astype(np.float64), axes=([3], [0]))
    return out


def as_arrays(out) -> list:
    return [t.numpy() for t in (out if isinstance(out, (list, tuple)) else [out])]


def compare(got, want) -> dict:
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = float(np.max(np.abs(want))) or 1.0
    diff = float(np.max(np.abs(got - want)))
    return {"max_abs_diff": diff, "scale": scale, "relative": diff / scale, "tolerance": TOLERANCE,
            "ok": bool(np.isfinite(got).all() and diff / scale <= TOLERANCE)}


def describe_tensorflow(tf, np, result: dict) -> list:
    """Record and print TensorFlow's version, what it was built with, and the GPUs it sees."""
    info = tf.sysconfig.get_build_info()
    result.update(tensorflow=tf.__version__, tensorflow_file=tf.__file__, numpy=np.__version__,
                  built_with={"cuda": info.get("cuda_version"), "cudnn": info.get("cudnn_version"),
                              "is_cuda_build": info.get("is_cuda_build")})
    print(f"TensorFlow {tf.__version__} from {os.path.dirname(tf.__file__)} (NumPy {np.__version__}); "
          f"built with CUDA {info.get('cuda_version')}, cuDNN {info.get('cudnn_version')}")
    gpus = tf.config.list_physical_devices("GPU")
    result["gpus"] = []
    for gpu in gpus:
        details = tf.config.experimental.get_device_details(gpu)
        result["gpus"].append({"name": gpu.name, "device": details.get("device_name"),
                               "compute_capability": details.get("compute_capability")})
    print(f"GPUs TensorFlow sees: {result['gpus'] or 'none'}")
    return gpus


def reference_ops(tf, np) -> tuple[dict, dict]:
    """The ops compared across devices (name -> callable) and their inputs, from a fixed seed."""
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal((8, 56, 56, 64)).astype(np.float32),
              "w": (rng.standard_normal((3, 3, 64, 64)) / 24).astype(np.float32),
              "a": rng.standard_normal((512, 512)).astype(np.float32),
              "b": rng.standard_normal((512, 512)).astype(np.float32),
              "upstream": rng.standard_normal((8, 56, 56, 64)).astype(np.float32)}
    x, w = inputs["x"], inputs["w"]

    def conv():
        return tf.nn.conv2d(x, w, strides=1, padding="SAME")

    def conv_backward():  # what training runs: cuDNN's backward-data and backward-filter kernels
        xv, wv = tf.constant(x), tf.constant(w)
        with tf.GradientTape() as tape:
            tape.watch([xv, wv])
            y = tf.nn.conv2d(xv, wv, strides=1, padding="SAME")
        return tape.gradient(y, [xv, wv], output_gradients=tf.constant(inputs["upstream"]))

    def matmul():
        return tf.linalg.matmul(inputs["a"], inputs["b"])

    return {"conv": conv, "conv_backward": conv_backward, "matmul": matmul}, inputs


def run_on_device(tf, op, device: str, on_cpu: list) -> dict:
    """One op on `device`, timed twice (the first call includes kernel selection), against the CPU's
    outputs: each output against its own scale (dx and dw differ by orders of magnitude); the worst counts."""
    try:
        with tf.device(device):
            t = time.perf_counter()
            first = as_arrays(op())
            t_first = time.perf_counter() - t
            t = time.perf_counter()
            as_arrays(op())
            t_again = time.perf_counter() - t
    except Exception as err:
        return {"ok": False, "error": f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"}
    entry = max((compare(g, c) for g, c in zip(first, on_cpu)), key=lambda e: e["relative"])
    entry["ok"] = all(compare(g, c)["ok"] for g, c in zip(first, on_cpu))
    entry.update(first_call_seconds=round(t_first, 3), second_call_seconds=round(t_again, 4))
    return entry


def report_libraries(result: dict) -> None:
    """Record and print the CUDA libraries this process loaded, and their runtime versions."""
    libs = loaded_libraries()
    result["libraries"] = {n: {"path": p, "bytes": os.path.getsize(p)} for n, p in libs.items()}
    result["runtime"] = runtime_versions(libs)
    print("CUDA libraries loaded:")
    for name, entry in result["libraries"].items():
        note = "  (empty stand-in)" if entry["bytes"] < 65536 else ""  # the real ones are megabytes
        print(f"  {name:<34} {entry['path']}{note}")
    rt = result["runtime"]
    if rt:
        print(f"loaded: CUDA runtime {rt.get('cudart')}, driver supports CUDA {rt.get('driver_supports_cuda')}, "
              f"cuDNN {rt.get('cudnn')} (built for CUDA {rt.get('cudnn_built_for_cuda')})")


def report_device_ops(result: dict, device: str) -> None:
    for name in GPU_OPS:
        e = result.get(name)
        if e is None:
            continue
        if "error" in e:
            print(f"{device} {name}: FAILED: {e['error']}")
        else:
            print(f"{device} {name} vs CPU: max difference {e['max_abs_diff']:.2e} of scale {e['scale']:.2e} = "
                  f"{e['relative']:.2e} (tolerance {TOLERANCE:.0e}): {'MATCHES' if e['ok'] else 'DIFFERS'}; "
                  f"first call {e['first_call_seconds']} s, second {e['second_call_seconds']} s")


def probe_stand_ins(tf, device: str, inputs: dict) -> None:
    """An FFT on the device: with the cuFFT stand-in it must fail cleanly, not crash."""
    print(f"probing the stand-ins: tf.signal.fft on {device} ...", flush=True)
    try:
        with tf.device(device):
            out = tf.signal.fft(tf.complex(inputs["a"][:8], inputs["b"][:8])).numpy()
        print(f"FFT ran: {out.shape} (cuFFT is the real library here, or the op ran elsewhere)")
    except Exception as err:
        print(f"FFT failed as expected with a stand-in: {type(err).__name__}: {str(err).strip().splitlines()[0]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-only", action="store_true", help="no GPU expected: check the import and a CPU convolution")
    parser.add_argument("--probe-stubs", action="store_true",
                        help="at the end, run an FFT on the device: with the cuFFT stand-in it must fail cleanly")
    parser.add_argument("--device", default="/GPU:0",
                        help="the device compared with the CPU (default /GPU:0; /CPU:0 exercises this script without a GPU)")
    args = parser.parse_args(argv)
    result: dict = {"ok": False}
    t0 = time.perf_counter()
    try:
        import numpy as np
        import tensorflow as tf
    except Exception as err:  # an import failure is the finding: report it, do not crash
        result["error"] = f"import failed: {type(err).__name__}: {err}"
        print(f"lms-bundle check: {result['error']}")
        print("RESULT " + json.dumps(result))
        return 1
    result["import_seconds"] = round(time.perf_counter() - t0, 2)
    gpus = describe_tensorflow(tf, np, result)

    tf.config.experimental.enable_tensor_float_32_execution(False)
    ops, inputs = reference_ops(tf, np)
    with tf.device("/CPU:0"):
        on_cpu = {name: as_arrays(op()) for name, op in ops.items()}
    result["cpu_conv_vs_numpy"] = compare(on_cpu["conv"][0], numpy_conv_same(inputs["x"], inputs["w"]))
    print(f"CPU convolution vs NumPy: relative difference {result['cpu_conv_vs_numpy']['relative']:.2e} "
          f"({'ok' if result['cpu_conv_vs_numpy']['ok'] else 'WRONG'})")

    if args.cpu_only:
        result["ok"] = result["cpu_conv_vs_numpy"]["ok"]
    elif not gpus and "GPU" in args.device.upper():
        result["error"] = ("TensorFlow sees no GPU: read TensorFlow's messages above (a CUDA library that did not "
                           "load is named there)")
    else:
        for name, op in ops.items():
            result[name] = run_on_device(tf, op, args.device, on_cpu[name])
        result["ok"] = all(result[name]["ok"] for name in ops)

    report_libraries(result)
    report_device_ops(result, args.device)
    if "error" in result:
        print(f"lms-bundle check: {result['error']}")
    print("RESULT " + json.dumps(result))
    if args.probe_stubs:  # last: if calling into a stand-in crashed the process, the result is out already
        probe_stand_ins(tf, args.device, inputs)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
