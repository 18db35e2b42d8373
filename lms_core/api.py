"""LMS for your own TensorFlow training step, without the launcher: one module to import.

    from lms_core import api

    target = api.make_target(link="pcie4", device="a100", device_memory="16GiB", host_memory="64GiB")
    config = api.LMSConfig(enabled=True, mode="auto")          # every setting: docs/lms.md
    rewritten, estimate = api.rewrite_within_estimate(train_step, *specs, config=config, target=target,
                                                      compute_device="/device:GPU:0", host_device="/device:CPU:0")
    gating = api.verify_gating(rewritten, images, labels)      # on the partitions TensorFlow executed
    print("\n".join(api.plan_report(rewritten, estimate, gating).lines()))  # ... "swap-ins gated: N/N"
    loss = rewritten(images, labels)                           # train with it as with train_step

`train_step` is a `tf.function` that runs forward, backward and the optimizer's update; `specs`
are the `tf.TensorSpec`s of its arguments (batch included). docs/api.md explains each call, what a
plan is and how to read the report. This module only gathers what lms_core already has, so that
its import path stays the same while the planning code moves.
"""
from __future__ import annotations

from lms_core.config import LMSConfig, SettingError
from lms_core.costs import PROFILES, DeviceProfile
from lms_core.link import LinkRates, link_named
from lms_core.planning import Target
from lms_core.report import MemoryEstimate, PlanReport, Verification
from lms_core.tf import estimate_rewrite, rewrite, rewrite_with_plan, rewrite_within_estimate
from lms_core.tf.gating import GatingReport, verify_gating
from lms_core.tf.reimport import RewrittenStep
from lms_core.units import parse_bytes

__all__ = ["LMSConfig", "SettingError", "Target", "make_target", "plan_report", "rewrite", "rewrite_within_estimate",
           "rewrite_with_plan", "estimate_rewrite", "verify_gating", "GatingReport", "RewrittenStep",
           "PlanReport", "MemoryEstimate", "Verification", "LinkRates", "DeviceProfile", "PROFILES"]


def make_target(link: str | float = "pcie3", device: str = "v100", device_memory: int | str | None = None,
                host_memory: int | str = "64GiB") -> Target:
    """What a plan is made for, from names and sizes as a recipe's `lms` section takes them:
    `link` a link name (pcie3, pcie4, pcie5, nvlink2, c2c) or GB/s; `device` a device profile
    (v100, a100, h100, h200: its peak rates, which the simulator times the step with);
    `device_memory` the memory the step may use on the device (default: the profile's own, e.g.
    16 GiB for v100), `host_memory` what swaps may park on the host; sizes in bytes or as "16GiB".
    Raises SettingError naming the argument and what it accepts."""
    try:
        rates = link_named(link)
    except ValueError as err:
        raise SettingError("link", str(err)) from None
    if device not in PROFILES:
        raise SettingError("device", f"must be one of {', '.join(PROFILES)}; got {device!r}")
    profile = PROFILES[device]
    sizes = {}
    for key, value in (("device_memory", device_memory), ("host_memory", host_memory)):
        try:
            sizes[key] = None if value is None else parse_bytes(value)
        except ValueError as err:
            raise SettingError(key, str(err)) from None
    memory = profile.memory_bytes if sizes["device_memory"] is None else sizes["device_memory"]
    return Target(link=rates, device=profile, device_memory_bytes=memory, host_memory_bytes=sizes["host_memory"])


def plan_report(rewritten: RewrittenStep, estimate: MemoryEstimate | None = None,
                gating: GatingReport | None = None) -> PlanReport:
    """The rewrite's plan report with Grappler's estimate and the gating check's verdict added, as
    `lms-launch plan` prints it (`.lines()`) and writes it (`.to_dict()`)."""
    report = rewritten.report
    if estimate is not None:
        report = report.with_estimate(estimate)
    if gating is not None:
        report = report.with_verification(gating.verification())
    return report
