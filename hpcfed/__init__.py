"""hpcfed: federated learning for HPC clusters.

One MPI job is one federation: rank 0 is the parameter server, ranks 1..K are client sites.
`import hpcfed` stays light; torch, mpi4py and h5py are imported where they are used.
"""

__version__ = "0.1.0"
