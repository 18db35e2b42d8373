"""Names of the environment variables the launcher sets or reads, in one place."""

# Set for every rank by the launcher (only where the user has not set them already).
TF_CPP_MIN_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL"  # 1 hides TensorFlow's INFO lines from every rank
PYTHONUNBUFFERED = "PYTHONUNBUFFERED"  # rank output reaches the terminal line by line

# Set by each rank for itself at start-up (launcher/launch/threads.py): the ranks on a host split its cores.
TF_NUM_INTRAOP_THREADS = "TF_NUM_INTRAOP_THREADS"
TF_NUM_INTEROP_THREADS = "TF_NUM_INTEROP_THREADS"
OMP_NUM_THREADS = "OMP_NUM_THREADS"

# What `--backend mpi` forwards to every rank with `-x` (mpirun passes on nothing it is not told to):
# the variables that steer Horovod, TensorFlow, NCCL, OpenMP/MKL, CUDA, XLA and Python, and the
# program and library search paths, from the launcher's environment. horovodrun (Gloo) forwards the
# launcher's whole environment itself.
MPI_FORWARD_PREFIXES = ("HOROVOD_", "TF_", "NCCL_", "OMP_", "KMP_", "MKL_", "CUDA_", "XLA_", "PYTHON")
MPI_FORWARD_NAMES = ("PATH", "LD_LIBRARY_PATH")
# Never forwarded, as horovodrun never forwards it either: each host's GPUs are its own, and the worker
# picks one per local rank.
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"

# Rank identity that horovodrun (Gloo) gives each rank.
HOROVOD_RANK = "HOROVOD_RANK"
HOROVOD_SIZE = "HOROVOD_SIZE"
HOROVOD_LOCAL_RANK = "HOROVOD_LOCAL_RANK"
HOROVOD_LOCAL_SIZE = "HOROVOD_LOCAL_SIZE"
HOROVOD_CROSS_RANK = "HOROVOD_CROSS_RANK"
HOROVOD_CROSS_SIZE = "HOROVOD_CROSS_SIZE"
HOROVOD_HOSTNAME = "HOROVOD_HOSTNAME"
HOROVOD_CONTROLLER = "HOROVOD_CONTROLLER"
HOROVOD_CPU_OPERATIONS = "HOROVOD_CPU_OPERATIONS"
HOROVOD_GLOO_RENDEZVOUS_ADDR = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
HOROVOD_GLOO_RENDEZVOUS_PORT = "HOROVOD_GLOO_RENDEZVOUS_PORT"

# What Horovod's Gloo reads besides the rank identity: the interface its connections use (horovodrun
# sets it from --network-interfaces; `--backend srun` too), and NCCL's, which horovodrun sets alike.
HOROVOD_GLOO_IFACE = "HOROVOD_GLOO_IFACE"
NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"

# Rank identity that Open MPI's mpirun gives each rank.
OMPI_COMM_WORLD_RANK = "OMPI_COMM_WORLD_RANK"
OMPI_COMM_WORLD_SIZE = "OMPI_COMM_WORLD_SIZE"
OMPI_COMM_WORLD_LOCAL_RANK = "OMPI_COMM_WORLD_LOCAL_RANK"
OMPI_COMM_WORLD_LOCAL_SIZE = "OMPI_COMM_WORLD_LOCAL_SIZE"

# What Slurm sets inside an allocation (sbatch, salloc), read by the launcher (launcher/launch/slurm.py):
# the job, its nodes (a compressed host list such as node[01-04]), its tasks per node (2(x3),1), whether
# the job asked for a task count at all (SLURM_NTASKS is set only then) and its GPUs per node.
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_JOB_NODELIST = "SLURM_JOB_NODELIST"
SLURM_TASKS_PER_NODE = "SLURM_TASKS_PER_NODE"
SLURM_NTASKS = "SLURM_NTASKS"
SLURM_GPUS_PER_NODE = "SLURM_GPUS_PER_NODE"
# What srun gives each task it starts: its index among the step's tasks, its index among the tasks on
# its node, and the node's name as Slurm knows it.
SLURM_PROCID = "SLURM_PROCID"
SLURM_LOCALID = "SLURM_LOCALID"
SLURMD_NODENAME = "SLURMD_NODENAME"
# Read by srun with --distribution=arbitrary: a file naming the node of each task, one per line.
SLURM_HOSTFILE = "SLURM_HOSTFILE"
# Set by `--backend srun` for srun's tasks: each rank takes its Horovod identity from Slurm's
# (launcher/launch/slurm.py), and meets the others at the launcher's Gloo rendezvous.
LMS_LAUNCH_SRUN = "LMS_LAUNCH_SRUN"

# Set by a GPU rank with LMS on before TensorFlow starts, unless the user set it (launcher/lms/host_memory.py):
# TensorFlow's cap on the pinned host memory that swap-outs land in.
TF_GPU_HOST_MEM_LIMIT_IN_MB = "TF_GPU_HOST_MEM_LIMIT_IN_MB"

# Read by scripts/install.sh: force the CUDA build of TensorFlow on or off.
LMS_LAUNCH_GPU = "LMS_LAUNCH_GPU"

# Set by `lms-launch bench --judge run` for each probe on a machine without a GPU (launcher/bench/run_judge.py):
# TensorFlow's CPU allocator is held to the device memory benchmarked, so a step that needs more fails as on a
# full GPU. (It caps TensorFlow's BFC allocator on the CPU, in MiB; read when TensorFlow starts.)
TF_CPU_BFC_MEM_LIMIT_IN_MB = "TF_CPU_BFC_MEM_LIMIT_IN_MB"

# Set by `lms-launch bench --judge run --device-memory M` for each probe on a GPU (launcher/bench/run_judge.py),
# read by a rank as it picks its GPU (launcher/rank/devices.py): the GPU is given to TensorFlow as one logical
# device of this many MiB instead of growing into all of it, so an H100 answers for the papers' 16 GB GPUs.
LMS_LAUNCH_GPU_MEMORY_LIMIT_MB = "LMS_LAUNCH_GPU_MEMORY_LIMIT_MB"

# Set by a rank whose CPU allocator is held to a limit (TF_CPU_BFC_MEM_LIMIT_IN_MB), unless the user set
# it: oneDNN's CPU kernels abort the process when an allocation fails (tensorflow/tensorflow#108621), so
# an out-of-memory error would end the rank with a crash instead of TensorFlow's error and our advice.
TF_ENABLE_ONEDNN_OPTS = "TF_ENABLE_ONEDNN_OPTS"

# Read by a rank with LMS on (launcher/lms/calibrate.py), for tests on machines without a GPU only:
# `RANK:EXTRA_BYTES[,RANK:EXTRA_BYTES...]` makes the listed CPU ranks calibrate, each reading its plans'
# peak as the simulator's predicted peak plus EXTRA_BYTES (what a GPU would hold beyond the model)
# instead of the CPU allocator's, which no plan moves. The steps themselves run as on a GPU.
LMS_LAUNCH_TEST_CALIBRATION = "LMS_LAUNCH_TEST_CALIBRATION"
