"""Starting the ranks: recipe -> command and environment (and a Slurm job's hosts, slurm.py), spawning
them, serving what srun's ranks need (rendezvous.py), copying results back, stopping them."""
