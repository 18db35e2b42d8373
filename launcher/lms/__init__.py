"""LMS in a rank: what it plans for (link, device, host memory), the step handed to lms_core, and the plan command."""
