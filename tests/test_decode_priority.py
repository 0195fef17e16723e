"""KernelImpl.decode_priority: single-token-query calls (decode steps) rank impls by it; other calls
by `priority`.  The cuda backend ranks SDPA-flash above cuDNN for decode only."""
import torch

from opsadv.core.kernel import CallSpec, KernelImpl


def _spec(s_q):
    return CallSpec("flash_attention", "cuda", torch.bfloat16, frozenset({"gqa"}), (s_q,), 64,
                    shapes=((8, 32, s_q, 64), (8, 4, 2048, 64)))


def test_priority_for_decode_only():
    impl = KernelImpl("x.a", "flash_attention", "x", fn=lambda *a: None, priority=100, decode_priority=300)
    plain = KernelImpl("x.b", "flash_attention", "x", fn=lambda *a: None, priority=200)
    assert impl.priority_for(_spec(1)) == 300 and impl.priority_for(_spec(2)) == 100
    assert plain.priority_for(_spec(1)) == 200 == plain.priority_for(_spec(7))
    assert impl.priority_for(CallSpec("flash_attention", "cuda", torch.bfloat16, frozenset(), (1,))) == 100


def test_cuda_sdpa_decode_order():
    from opsadv.backends.cuda import sdpa
    by_id = {i.id: i for i in sdpa.impls(None)}
    cudnn, flash = by_id["cuda.sdpa.cudnn"], by_id["cuda.sdpa.flash"]
    assert flash.priority_for(_spec(1)) > cudnn.priority_for(_spec(1))
    assert cudnn.priority_for(_spec(128)) > flash.priority_for(_spec(128))
