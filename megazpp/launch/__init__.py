"""Starting ranks: gloo ranks on this machine for tests and tools (`local_ranks`), one node's
torchrun launcher behind `run.sh` (`node_launcher`) and the ranks' tie to it (`lifeline`), the
node variables from a SLURM job (`slurm`), a hostfile launcher over ssh or pdsh (`hosts`, with
`host_guard` guarding each host's run), and the checks every node passes before training
(`preflight`).

`slurm`, `hosts` and `host_guard` use the standard library only, so `run.sh` and
`tools/launch_hosts.sh` can call them before the project's dependencies are installed; nothing
is imported here, so that stays true.
"""
