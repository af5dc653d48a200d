"""Stand-ins for Megatron-FSDP's hook registration (its local functions carry megatron-core
0.19.2's qualified names) and for TE's make_graphed_callables, on plain ``torch.nn`` modules."""

import functools

import torch

from megatron.patchset.features.fsdp_cuda_graphs import fsdp_hooks


class _Release(torch.autograd.Function):
    """Identity whose backward calls a handler (FSDP's RegisterFSDPBackwardFunction)."""

    @staticmethod
    def forward(ctx, handler, x):
        ctx.handler = handler
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.handler()
        return None, grad


class MegatronFSDP:
    """Registers on a unit module the four hooks megatron-core 0.19.2 registers on an FSDP
    unit, plus a root pre-backward wrapper and gradient hooks; every handler appends to
    ``log``. (Named like the real class: the hooks' qualified names are what the fork's markers
    recognise.)"""

    def __init__(self, log):
        self.log = log
        self.grad_acc_hooks = {}

    def _register_fsdp_hooks(self, unit, root=None):
        log = self.log

        @torch.compiler.disable
        def _pre_forward_param_unshard(module, *unused):
            log.append("unshard")

        def _post_backward_release_module(module, *unused):
            log.append("post_backward_release")

        @torch.compiler.disable
        def _register_post_backward_hook(post_backward_hook, module, args, kwargs):
            if not torch.is_grad_enabled():
                return args, kwargs
            args = tuple(
                _Release.apply(functools.partial(post_backward_hook, module), a)
                if torch.is_tensor(a) and a.requires_grad
                else a
                for a in args
            )
            return args, kwargs

        @torch.compiler.disable
        def _post_forward(module, input, output):
            log.append("reshard")
            return output

        @torch.compiler.disable
        def _pre_backward_param_unshard(module, *unused):
            log.append("pre_backward_unshard")

        def _root_pre_backward(module, *unused):
            log.append("root_pre_backward")

        @torch.compiler.disable
        def _process_post_backward_gradients(params):
            log.append("process_grads")

        def create_custom_backward_hook(module, custom_backward_handler):
            @torch.compiler.disable
            def forward_hook(_module, inputs, output):
                outputs = [output] if torch.is_tensor(output) else list(output)
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, lambda grads: custom_backward_handler(_module, grads), mode="any"
                )
                return output

            return module.register_forward_hook(forward_hook)

        unit.register_forward_pre_hook(_pre_forward_param_unshard, prepend=True, with_kwargs=True)
        unit.register_forward_hook(_post_forward, prepend=False)
        create_custom_backward_hook(unit, _pre_backward_param_unshard)
        unit.register_forward_pre_hook(
            functools.partial(_register_post_backward_hook, _post_backward_release_module),
            with_kwargs=True,
        )
        if root is not None:
            create_custom_backward_hook(root, _root_pre_backward)
        for i, p in enumerate(unit.parameters()):
            self.grad_acc_hooks[f"param {i}"] = p.register_post_accumulate_grad_hook(
                lambda p: _process_post_backward_gradients([p])
            )
        fsdp_hooks.mark_module_hooks((root or unit).modules())
        return self


def unit_and_log(with_root=False):
    log = []
    unit = torch.nn.Linear(4, 4)
    root = torch.nn.Sequential(unit) if with_root else None
    registrar = MegatronFSDP(log)._register_fsdp_hooks(unit, root)
    return unit, root, registrar, log
