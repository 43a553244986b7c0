from .etcd import etcd_server  # noqa: F401  (fixture)
from .netns import netns_nodes  # noqa: F401  (fixture)
from .procs import launch, startup_seconds  # noqa: F401  (fixtures)
from .s3 import s3_bucket, s3_server  # noqa: F401  (fixtures)
