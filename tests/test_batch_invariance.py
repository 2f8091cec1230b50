"""Batch invariance of the CPU kernels in bfloat16: a row's result does not depend on the other rows beside it. A
verify pass over several positions computes, bit for bit, what decoding them one at a time computes; a token tree's
node what decoding its path computes. That is what makes speculative decoding's greedy output equal plain
decoding's in bfloat16, on every instruction set this CPU runs."""
import random
from types import SimpleNamespace

import pytest
import torch

import cpu_gemv
import generate as gen
import quantize
import speculative
from checkpoint import load_model
from generate import DEFAULT_CHECKPOINT
from model import ModelArgs, Transformer, kv_bucket
from trees import Tree, path_to, tree_inputs

TARGETS = [name for name, _, _ in cpu_gemv.targets(cpu_gemv.cpu_flags())]
pytestmark = pytest.mark.skipif(not TARGETS or cpu_gemv.load() is None, reason="no kernels for this CPU or no g++")


@pytest.fixture(params=TARGETS)
def kernels(request):
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))  # the kernels split work among threads: two at least, as decode runs
    assert cpu_gemv.load(request.param) == request.param
    yield request.param
    cpu_gemv.load()
    torch.set_num_threads(threads)


def bf16_model(head_dim: int, kv_cache=None, weights: str = "bf16", kv_heads: int = 2, hidden: int = 96) -> Transformer:
    """A random model on the CPU kernels with three query heads per KV head (as SmolLM2 has), and a cache long
    enough that the attention splits it into several parts; weights "bf16", "int8" or "int4" (activations bf16)."""
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=64, n_layer=2, n_head=3 * kv_heads, n_kv_head=kv_heads, dim=3 * kv_heads * head_dim,
                     intermediate_size=hidden, block_size=1024)
    model = Transformer(args).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    if weights != "bf16":
        state = quantize.quantized_state(model, weights, 32)
        model = quantize.install(Transformer(args), weights, 32)
        model.load_state_dict(state, assign=True)
    model = model.bfloat16().eval()
    cpu_gemv.install(model)
    model.setup_caches(1, 1024, kv_cache)
    return model


def prefill(model, prompt: list[int]):
    T = len(prompt)
    model(torch.tensor([prompt]), model.context(torch.arange(T), None, kv_bucket(T, model.max_seq_length)))


def decode(model, tokens: list[int], base: int) -> list[torch.Tensor]:
    """The logits after each token, fed one at a time from cache slot base."""
    return [model(torch.tensor([[t]]), model.context(torch.arange(base + i, base + i + 1), None, kv_bucket(base + i + 1, model.max_seq_length)))[0, -1] for i, t in enumerate(tokens)]


@pytest.mark.parametrize("head_dim, kv_cache", [(32, None), (64, None), (64, torch.int8)])
@torch.inference_mode()
def test_a_verify_pass_computes_each_position_as_decoding_it_alone_does(kernels, head_dim, kv_cache):
    model = bf16_model(head_dim, kv_cache)
    rng = random.Random(1)
    for T, M in ((40, 6), (300, 17), (250, 32)):  # the last crosses a part boundary of the attention
        tokens = [rng.randrange(64) for _ in range(T + M)]
        prefill(model, tokens[:T])
        many = model(torch.tensor([tokens[T:]]), model.context(torch.arange(T, T + M), None, kv_bucket(T + M, model.max_seq_length)))[0]
        one = decode(model, tokens[T:], T)
        assert all(torch.equal(one[i], many[i]) for i in range(M)), (T, M)


@pytest.mark.parametrize("K", [576, 608, 2048])  # 608: 2 steps of 256 and a last few blocks
@pytest.mark.parametrize("f32", [False, True])  # True: the output head's product
@torch.inference_mode()
def test_an_int8_weight_product_computes_each_row_as_it_would_alone(kernels, K, f32):
    torch.manual_seed(K)
    # 43 weight rows: the last 3 short of a block of 8
    w, scales = torch.randint(-127, 128, (43, K), dtype=torch.int8), (torch.rand(43) / 50).bfloat16()
    x = torch.randn(32, K).bfloat16()
    alone = torch.cat([torch.ops.fast_decode.gemv_int8(x[m : m + 1], w, scales, f32) for m in range(32)])
    for M in (2, 3, 5, 8, 16, 17, 32):
        assert torch.equal(torch.ops.fast_decode.gemv_int8(x[:M], w, scales, f32), alone[:M]), M


# 640 and 1536 by 256: the last groups past a multiple of 8, with groups of 128 or more
@pytest.mark.parametrize("K, G", [(576, 32), (576, 64), (1024, 128), (2048, 256), (640, 128), (1536, 256)])
@pytest.mark.parametrize("f32", [False, True])  # True: the output head's product
@torch.inference_mode()
def test_an_int4_weight_product_of_up_to_32_rows_computes_each_row_as_it_would_alone(kernels, K, G, f32):
    torch.manual_seed(K + G)
    q, scales, zeros = quantize.quantize_int4(torch.randn(43, K), G)  # 43 rows: the last 3 short of a block of 8
    w, x = quantize.pack_nibbles(q), torch.randn(32, K).bfloat16()
    alone = torch.cat([torch.ops.fast_decode.gemv_int4(x[m : m + 1], w, scales, zeros, f32) for m in range(32)])
    for M in (2, 3, 5, 7, 8, 16, 17, 32):  # tiles of 4 rows of x, then 2, then 1
        assert torch.equal(torch.ops.fast_decode.gemv_int4(x[:M], w, scales, zeros, f32), alone[:M]), M


AMX = [t for t in TARGETS if t.endswith("+amx")]


@pytest.mark.skipif(not AMX or "amx_int8" not in cpu_gemv.cpu_flags(), reason="this CPU has no AMX int8 tiles")
@pytest.mark.parametrize("K, G", [(576, 64), (640, 128), (1536, 256)])
@torch.inference_mode()
def test_on_amx_an_int4_product_of_a_prompts_rows_computes_each_row_as_it_would_alone(K, G):
    assert cpu_gemv.load(AMX[0]) == AMX[0]
    torch.manual_seed(K + G)
    q, scales, zeros = quantize.quantize_int4(torch.randn(45, K), G)  # 45 rows: a last block of 32 cut short
    w, x = quantize.pack_nibbles(q), torch.randn(130, K).bfloat16()
    alone = torch.cat([torch.ops.fast_decode.gemv_int4(x[m : m + 1], w, scales, zeros, False) for m in range(130)])
    layer = cpu_gemv.GemvInt4(SimpleNamespace(in_features=K, out_features=45, weight=w, scales=scales, zeros=zeros),
                              torch.bfloat16)
    assert cpu_gemv.int4_rows_alone(layer)  # so a prompt goes through the step 128 positions a pass
    for M in (33, 64, 127, 130):  # past the 32 rows the other kernel sets compute alone
        assert torch.equal(torch.ops.fast_decode.gemv_int4(x[:M], w, scales, zeros, False), alone[:M]), M
    cpu_gemv.load()


@pytest.mark.parametrize("weights", ["int8", "int4"])
@torch.inference_mode()
def test_a_verify_pass_with_quantized_weights_computes_what_decoding_does(kernels, weights):
    model = bf16_model(64, weights=weights)
    rng = random.Random(5)
    tokens = [rng.randrange(64) for _ in range(120)]
    prefill(model, tokens[:100])
    many = model(torch.tensor([tokens[100:]]), model.context(torch.arange(100, 120), None, kv_bucket(120, model.max_seq_length)))[0]
    one = decode(model, tokens[100:], 100)
    assert all(torch.equal(one[i], many[i]) for i in range(20))


def random_tree(rng, root: int, nodes: int) -> Tree:
    tree = Tree([root])
    for i in range(1, nodes):
        tree.add(rng.randrange(i), rng.randrange(64), 0.5)
    return tree


@pytest.mark.parametrize("head_dim", [32, 64])
@torch.inference_mode()
def test_a_token_trees_node_computes_what_decoding_its_path_computes(kernels, head_dim):
    """Each node sees its context and its ancestors, with its siblings' slots between them; it comes out as the last
    token of its path decoded one token at a time, also where the tree straddles a part boundary of the attention."""
    model = bf16_model(head_dim)
    rng = random.Random(2)
    for base, nodes in ((20, 12), (240, 32)):
        context = [rng.randrange(64) for _ in range(base)]
        tree = random_tree(rng, rng.randrange(64), nodes)
        nodes = len(tree.tokens)  # siblings with the same token are one node
        prefill(model, context)
        kv_len = kv_bucket(base + nodes, model.max_seq_length)
        mask, pos = tree_inputs(tree, base, range(nodes), kv_len, 0, "cpu")
        many = model(torch.tensor([tree.tokens]), model.context(torch.arange(base, base + nodes), None, kv_len, mask=mask, pos=pos))[0]
        for node in range(nodes):
            path = [tree.tokens[0]] + path_to(tree, node)
            assert torch.equal(decode(model, path, base)[-1], many[node]), (base, node)


@pytest.fixture(scope="module")
def builtin_pair():
    target = load_model(DEFAULT_CHECKPOINT, "cpu", torch.bfloat16)
    draft = load_model(DEFAULT_CHECKPOINT.parent / "stdlib-draft", "cpu", torch.bfloat16)
    for m in (target, draft):
        m.setup_caches(1, 512)
    return target, draft


@pytest.mark.parametrize("speculate", speculative.SPECULATE)
def test_every_speculative_method_decodes_greedily_what_plain_decoding_does_in_bfloat16(kernels, builtin_pair,
                                                                                       speculate):
    target, draft = builtin_pair
    drafted = speculate in ("auto", "draft", "tree", "staged")
    rng = random.Random(3)
    for _ in range(2):
        prompt = [rng.randrange(3, target.args.vocab_size) for _ in range(rng.randrange(20, 200))]
        plain = gen.generate(target, [prompt], 48, temperature=0).rows[0]
        loop = speculative.make_loop(target, max_new_tokens=48, speculate=speculate,
                                     draft=draft if drafted else None, temperature=0)
        assert loop([prompt]).rows[0] == plain, speculate


@pytest.mark.parametrize("kv_cache, weights", [(None, "bf16"), (torch.int8, "bf16"), (None, "int8")])
@torch.inference_mode()
def test_the_cpp_steps_verify_rows_compute_what_its_one_token_step_computes(kernels, kv_cache, weights):
    """Batch-1 decoding runs cpu_step's C++ step and verify passes its rows (a chain, then a
    token tree): each row is that step's logits for its token, bit for bit."""
    import cpu_step
    model = bf16_model(64, kv_cache, weights)
    rng = random.Random(4)
    base, tokens = 250, [rng.randrange(64) for _ in range(262)]
    prefill(model, tokens[:base])
    from backend import Backend
    backend = Backend(model)
    assert backend.cpp() is not None
    many = backend.verify(torch.tensor([tokens[base:]]), torch.arange(base, len(tokens)), 0).clone()
    one = cpu_step.step_for(model)
    for i, t in enumerate(tokens[base:]):
        assert torch.equal(one(torch.tensor([[t]]), torch.tensor([base + i]))[0], many[i]), i
    if kv_cache is torch.int8 and "vnni" in kernels:
        return  # over an int8 cache, VNNI's attention rounds a block's weights to 8 bits: a tree's are not decoding's
    tree = random_tree(rng, tokens[base], 20)
    n = len(tree.tokens)
    mask, pos = tree_inputs(tree, base, range(n), kv_bucket(base + n, model.max_seq_length), 0, "cpu")
    many = backend.verify(torch.tensor([tree.tokens]), torch.arange(base, base + n), 0, mask, pos).clone()
    for node in range(n):
        path = [tree.tokens[0]] + path_to(tree, node)
        for i, t in enumerate(path):
            got = one(torch.tensor([[t]]), torch.tensor([base + i]))[0]
        assert torch.equal(got, many[node]), node


@pytest.mark.parametrize("weights", ["bf16", "int8"])
@torch.inference_mode()
def test_the_cpp_steps_rows_of_a_prompt_piece_compute_what_its_one_token_step_computes(kernels, weights):
    """A prompt's piece of 100 positions in one pass (its attention split into groups of positions) gives each
    position the one-token step's logits, bit for bit."""
    import cpu_step
    from backend import Backend
    model = bf16_model(64, None, weights)
    rng = random.Random(5)
    base, tokens = 40, [rng.randrange(64) for _ in range(140)]
    prefill(model, tokens[:base])
    many = Backend(model).verify(torch.tensor([tokens[base:]]), torch.arange(base, len(tokens)), 0).clone()
    one = cpu_step.step_for(model)
    for i, t in enumerate(tokens[base:]):
        assert torch.equal(one(torch.tensor([[t]]), torch.tensor([base + i]))[0], many[i]), i
