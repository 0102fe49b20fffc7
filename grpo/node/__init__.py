"""The node and its devices: the device check (device.py), the GPU split of one node (gpu_layout.py), the cluster's
file check (cluster_check.py), memory release (memory.py) and the environment check run by setup (envcheck.py)."""
