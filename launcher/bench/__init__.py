"""`lms-launch bench max-batch|max-resolution RECIPE`: the largest batch, or the largest square or cubic
input, that fits a device, for no swapping, TensorFlow's own Grappler swapping and lms-launch, side by
side with the papers' figures.

    search.py         galloping then bisection over the sizes a model accepts (pure, no TensorFlow)
    sizes.py          what a size is for each command: the batch, or the side of the input
    steps.py          the training step at a size (the model is built once for max-batch), and its floor
    configurations.py the three configurations, each judged by Grappler's estimate
    run_judge.py      the same configurations judged by a real training step in a fresh process
    probe_worker.py   that process: one rank of the worker with Grappler's memory optimizer set
    papers.py         the published figures the results are compared with
    report.py         the Markdown table, the CSV, the PNG chart, written atomically
    command.py        the command line
"""
