from .etcd import etcd_server  # noqa: F401  (fixture)
from .procs import launch  # noqa: F401  (fixture)
