"""From a command line to running ranks: the parent process that starts a job under mpiexec
(`hpcfed.launch.parent`), the body of one rank (`hpcfed.launch.rank`), the cross-job server and
sites (`crossjob`, `crossjob_sites`), the launcher's watch over its ranks (`jobwatch`,
`rank_guard`) and a rank's device (`device`).
"""
