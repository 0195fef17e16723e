"""What the cuda backend's op folders share: Gluon host helpers (gluon.py), the Gluon device helpers of the
attention kernels' K/V ring (gluon_kv_ring.py) and of the persistent GEMMs' A/B ring (gluon_gemm_ring.py).  No op
folder imports another op folder's private helpers; what two ops share lives here.  Triton helpers the rocm and
jetson backends use too are in opsadv/backends/triton_common/ (utils.py, tma.py)."""
