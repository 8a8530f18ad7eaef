"""``AutoDistributedModelForCausalLM``: a 🤗 causal LM whose transformer blocks run on the swarm.

"The family's CausalLM, but all transformer layers are hosted by the swarm": embeddings, final norm and
LM head load locally (only their tensors are read); ``model.blocks`` is a ``RemoteSequential``.
It is a real ``PreTrainedModel`` + ``GenerationMixin``, so ``generate()``, logits processors,
``output_hidden_states``, autograd and custom loops over ``model(...)`` work as usual.

Sessions: inside ``with model.inference_session(max_length=...) as s:`` a forward call appends its
tokens after what the session already holds (like passing a KV cache to a local model), and
``generate()`` continues from the session — when its ``input_ids`` share a prefix with the tokens the
session has processed, only the rest is sent (an earlier divergence rolls the servers' caches back).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from transformers import AutoConfig, GenerationConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from swarm_client.config import default_dht_prefix, parse_initial_peers
from swarm_client.errors import InvalidInputError
from swarm_client.families import Family, get_family
from swarm_client.local_span import DEFAULT_CACHE_TOKENS, LocalSpan, parse_local_blocks
from swarm_client.model_source import resolve_model_path
from swarm_client.remote_sequential import RemoteSequential
from swarm_client.sequence_manager import ClientConfig, SequenceManager
from swarm_client.session import InferenceSession
from swarm_client.weights import load_tensors

logger = logging.getLogger(__name__)

#: placeholder "token id" for positions fed as embeddings (never equal to a real token)
EMBEDDING_POSITION = -1


class DistributedModelForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = PretrainedConfig
    base_model_prefix = "swarm"
    main_input_name = "input_ids"
    _supports_cache_class = False

    def __init__(self, config: PretrainedConfig, family: Family, head: torch.nn.Module, manager: SequenceManager):
        super().__init__(config)
        self.family = family
        self.head = head
        self.blocks = RemoteSequential(manager)
        self._active_session: InferenceSession | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(  # type: ignore[override]
        cls,
        name_or_path: str,
        initial_peers: list[str] | str,
        *,
        dht_prefix: str | None = None,
        dtype: torch.dtype = torch.float32,
        dht=None,
        local_blocks: str | tuple[int, int] | None = None,
        device: str | torch.device = "cpu",
        local_cache_tokens: int = DEFAULT_CACHE_TOKENS,
        serve_local: bool = False,
        **client_options,
    ) -> DistributedModelForCausalLM:
        model_dir = resolve_model_path(name_or_path)
        config = AutoConfig.from_pretrained(model_dir)
        family = get_family(config)
        local = parse_local_blocks(local_blocks, config.num_hidden_layers)
        if serve_local:
            raise NotImplementedError("serve_local (announcing the local blocks to the swarm) is not built yet")
        client_config = ClientConfig(
            initial_peers=parse_initial_peers(initial_peers),
            dht_prefix=dht_prefix or default_dht_prefix(name_or_path),
            num_blocks=config.num_hidden_layers,
            **client_options,
        )
        manager = SequenceManager(client_config, dht=dht)
        manager.start_discovery()  # the swarm is read and its servers pinged while the local weights load
        try:
            tensors = load_tensors(model_dir, family.head_prefixes(config), dtype=dtype, progress=False)
            head = family.build_head(config, tensors)
            if local is not None:  # only these blocks' tensors are read; they run on ``device``
                manager.local = LocalSpan.load(
                    model_dir, config, family, *local, dtype=dtype, device=device, max_cache_tokens=local_cache_tokens
                )
        except BaseException:
            manager.shutdown()
            raise
        model = cls(config, family, head, manager)
        try:
            model.generation_config = GenerationConfig.from_pretrained(model_dir)
        except OSError:
            model.generation_config = GenerationConfig.from_model_config(config)
        model.name_or_path = str(name_or_path)
        model.eval()
        return model

    @property
    def manager(self) -> SequenceManager:
        return self.blocks.manager

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.head.embeddings

    def can_generate(self) -> bool:  # type: ignore[override]
        return True

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return next(self.head.parameters()).device

    def shutdown(self) -> None:
        self.manager.shutdown()

    # ------------------------------------------------------------------ sessions
    @contextlib.contextmanager
    def inference_session(
        self,
        max_length: int = 0,
        batch_size: int = 1,
        session_id: str | None = None,
        keep_on_close: bool = False,
        resume_state: dict | None = None,
        adapter: str | None = None,
    ) -> Iterator[InferenceSession]:
        """Open a session whose KV caches live on the servers; forward/generate inside it use it.

        ``keep_on_close=True`` leaves the caches on the servers (for their session TTL) after the block;
        ``resume_state`` (from ``session.export_state()``) re-attaches to such caches, e.g. in the next
        chat turn — raising ``SessionNotFoundError`` if they are gone. ``adapter``: the served LoRA adapter
        the session runs with (default: ``active_adapter`` given to ``from_pretrained``; None: base model).
        """
        if resume_state is not None:
            session = InferenceSession.resume(self.manager, resume_state, keep_on_close)
        else:
            session = self.blocks.inference_session(max_length, batch_size, session_id, keep_on_close, adapter)
        previous, self._active_session = self._active_session, session
        try:
            yield session
        finally:
            self._active_session = previous
            session.close()

    @property
    def active_session(self) -> InferenceSession | None:
        return self._active_session

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        session: InferenceSession | None = None,
        prompts: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """🤗-style forward; ``prompts [num_blocks, B or 1, P, H]`` are deep prompts (stateless path only).

        ``inputs_embeds`` go through the family's input transform (``Head.embed_inputs``: BLOOM's embedding
        layernorm), as in 🤗, so ``model(inputs_embeds=model.get_input_embeddings()(ids))`` equals
        ``model(ids)``.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise InvalidInputError("pass exactly one of input_ids or inputs_embeds")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise InvalidInputError("padding (attention_mask with zeros) is not supported; use equal-length rows")
        hidden = self.head.embed(input_ids) if inputs_embeds is None else self.head.embed_inputs(inputs_embeds)
        session = session or self._active_session
        if session is not None and prompts is not None:
            raise InvalidInputError("deep prompts work in the stateless forward only, not in a session")
        states: list[torch.Tensor] = []
        if session is not None:
            fed = input_ids if input_ids is not None else None
            out = session.step(hidden.detach().float(), output_hidden_states=bool(output_hidden_states))
            if output_hidden_states:
                states = list(out.unbind(0))
                out = states[-1]
            columns = (
                [tuple(c) for c in fed.T.tolist()]
                if fed is not None
                else [(EMBEDDING_POSITION,) * hidden.shape[0]] * hidden.shape[1]
            )
            session.token_ids.extend(columns)
            out = out.to(hidden.dtype)
        elif output_hidden_states:
            out, states = self.blocks.forward_with_states(hidden, prompts)
        else:
            out = self.blocks(hidden, prompts)
        logits = self.head.final(out)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
            )
        hidden_states = None
        if output_hidden_states:
            # 🤗 convention: embeddings, each block's output, and the last one after the final norm
            hidden_states = (hidden, *states[:-1], self.head.final_norm(states[-1]))
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=hidden_states)

    # ------------------------------------------------------------------ generation
    def prepare_inputs_for_generation(  # type: ignore[override]
        self, input_ids: torch.LongTensor, inputs_embeds: torch.Tensor | None = None, **kwargs
    ) -> dict:
        session = self._active_session
        assert session is not None, "generate() runs inside an inference session"
        prefix = self._generation_prefix
        if inputs_embeds is not None and session.position == 0:
            self._generation_prefix = inputs_embeds.shape[1]
            return {"inputs_embeds": inputs_embeds, "session": session, **self._passthrough(kwargs)}
        wanted = [(EMBEDDING_POSITION,) * input_ids.shape[0]] * prefix + [tuple(c) for c in input_ids.T.tolist()]
        common = 0
        held = session.token_ids
        while common < min(len(held), len(wanted)) and held[common] == wanted[common]:
            common += 1
        common = min(common, len(wanted) - 1)  # always feed at least one token to get logits
        if common < session.position:
            session.rollback(common)
        new_ids = input_ids[:, common - prefix :]
        return {"input_ids": new_ids, "session": session, **self._passthrough(kwargs)}

    @staticmethod
    def _passthrough(kwargs: dict) -> dict:
        return {k: v for k, v in kwargs.items() if k in ("output_hidden_states", "return_dict")}

    _generation_prefix = 0

    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, *args, session: InferenceSession | None = None, **kwargs):
        """🤗 ``generate`` over the swarm; opens a session sized for the request unless one is active."""
        kwargs["use_cache"] = False  # the servers hold the cache; 🤗 must not build its own
        self._generation_prefix = 0
        if session is not None or self._active_session is not None:
            previous = self._active_session
            self._active_session = session or previous
            try:
                return super().generate(inputs, *args, **kwargs)
            finally:
                self._active_session = previous
        source = inputs if inputs is not None else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        batch, length = (source.shape[0], source.shape[1]) if source is not None else (1, 1)
        gen = kwargs.get("generation_config") or self.generation_config
        max_new = kwargs.get("max_new_tokens", getattr(gen, "max_new_tokens", None))
        max_length = length + max_new if max_new is not None else kwargs.get("max_length", gen.max_length)
        with self.inference_session(max_length=max(int(max_length), length + 1), batch_size=batch):
            return super().generate(inputs, *args, **kwargs)


class AutoDistributedModelForCausalLM:
    """Entry point mirroring ``AutoModelForCausalLM``: picks the family from the checkpoint's config."""

    @staticmethod
    def from_pretrained(name_or_path: str, initial_peers: list[str] | str, **kwargs) -> DistributedModelForCausalLM:
        """Load the local head of ``name_or_path`` and join the swarm at ``initial_peers``.

        ``local_blocks="a:b"`` (or ``(a, b)``) also loads blocks ``[a, b)`` here, on ``device`` in ``dtype``: they
        run in place as a zero-latency hop of every route (``local_span``), within a KV-cache budget of
        ``local_cache_tokens``; the servers run the rest. Other keywords are ``ClientConfig`` options, e.g.
        ``trusted_peers=[peer ids]`` (the only servers allowed to run the first and the last block) or
        ``spot_check_rate=0`` (no spot checks)."""
        return DistributedModelForCausalLM.from_pretrained(name_or_path, initial_peers, **kwargs)
