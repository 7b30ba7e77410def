"""Starting one job on several nodes: the node variables from a SLURM job (`slurm`), a
hostfile launcher over ssh or pdsh (`hosts`, with `node` guarding each host's run), and the
checks every node passes before training (`preflight`).

`slurm`, `hosts` and `node` use the standard library only, so `run.sh` and
`tools/launch_hosts.sh` can call them before the project's dependencies are installed.
"""
