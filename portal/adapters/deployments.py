"""Deployments: which version `tenant/name` serves (weights, canary splits, rollback) and
whether the adapter is kept warm (pinned) on the workers.

    deployment_set_weights(adapter=, weights={3: 90, 4: 10}, actor=)   ready versions, weights >= 0,
        sum > 0; {} = the newest ready version. Audited; effective on the next request.
    deployment_set_always_warm(adapter=, enabled=, actor=)   plan-gated
        (plan_for(tenant.plan).always_warm_adapters; over the limit -> LimitExceeded, a 403);
        after commit the deployed versions are staged and pinned on every worker, or unpinned.
    deployment_set_evaluation_gate(adapter=, require=, min_pass_rate=, actor=)   a version new to
        traffic must have passed its evaluation (portal.evals); a weight of 0 is never refused
    deployment_update(adapter=, actor=, weights=, always_warm=, require_evaluation=,
        evaluation_min_pass_rate=)   any of them, one transaction
    deployment_get(adapter=)   the adapter's Deployment (made on first use)

Which version a request gets (the weights, read) is portal.adapters.traffic.
"""

from __future__ import annotations

from functools import partial

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from portal.adapters import limits, staging
from portal.adapters.models import Adapter, AdapterVersion, AuditEvent, Deployment
from portal.adapters.traffic import deployed_versions
from portal.core.exceptions import InvalidInput
from portal.evals.selectors import evaluation_gate_refusal
from portal.tenants.models import Tenant
from portal.tenants.plans import plan_for

MAX_WEIGHT = 1_000_000


def _actor(actor):
    return actor if actor is not None and getattr(actor, "is_authenticated", False) else None


def _audit(*, adapter: Adapter, actor, action: str, details: dict) -> None:
    AuditEvent.objects.create(tenant=adapter.tenant, actor=_actor(actor), action=action, target=adapter.public_id,
                              details=details)


def _clean_weights(adapter: Adapter, weights: dict) -> dict[str, int]:
    if not isinstance(weights, dict):
        raise InvalidInput("weights", "expected an object {version number: weight}")
    ready = set(adapter.versions.filter(status=AdapterVersion.Status.READY).values_list("number", flat=True))
    clean: dict[int, int] = {}
    for key, weight in weights.items():
        try:
            number = int(str(key).lstrip("v"))
        except ValueError:
            raise InvalidInput("weights", f"{key!r} is not a version number") from None
        if number in clean:
            raise InvalidInput("weights", f"v{number} is given twice")
        if isinstance(weight, bool) or not isinstance(weight, int):
            raise InvalidInput("weights", f"v{number}: a weight must be an integer, got {weight!r}")
        if weight < 0 or weight > MAX_WEIGHT:
            raise InvalidInput("weights", f"v{number}: a weight must be between 0 and {MAX_WEIGHT}, got {weight}")
        if number not in ready:
            raise InvalidInput("weights", f"v{number} is not a ready version of {adapter.public_id}")
        clean[number] = weight
    if clean and sum(clean.values()) <= 0:
        raise InvalidInput("weights", "the weights must add up to more than 0")
    return {str(n): w for n, w in sorted(clean.items())}


def _check_evaluation_gate(adapter: Adapter, deployment: Deployment, clean: dict[str, int]) -> None:
    """Under require_evaluation, a version that gets traffic it does not get now must have
    passed its evaluation (portal.evals.selectors.evaluation_gate_refusal); InvalidInput naming
    the version and the figures otherwise. A weight of 0 (a rollback) is never refused."""
    if not deployment.require_evaluation:
        return
    serving = {v.number for v in deployed_versions(adapter=adapter)}
    if clean:
        gaining = [int(n) for n, w in clean.items() if w > 0 and int(n) not in serving]
    else:  # {} = the newest ready version
        newest = adapter.versions.filter(status=AdapterVersion.Status.READY, retired_at__isnull=True) \
            .order_by("-number").first()
        gaining = [newest.number] if newest is not None and newest.number not in serving else []
    for version in adapter.versions.filter(number__in=gaining).select_related("adapter__tenant").order_by("number"):
        refusal = evaluation_gate_refusal(version=version, deployment=deployment)
        if refusal is not None:
            raise InvalidInput("weights", refusal)


def deployment_set_weights(*, adapter: Adapter, weights: dict[int, int], actor: AbstractBaseUser | None) -> Deployment:
    """Replace the deployment's weights ({} = newest ready version). Rollback is this call with
    the old version's weight; it takes effect on the next request. Under the evaluation gate a
    version new to traffic must have passed its evaluation."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get_or_create(adapter=adapter)[0]
        clean = _clean_weights(adapter, weights)
        _check_evaluation_gate(adapter, deployment, clean)
        previous = dict(deployment.weights or {})
        deployment.weights = clean
        deployment.updated_by = _actor(actor)
        deployment.save()
        _audit(adapter=adapter, actor=actor, action="deployment.weights_set",
               details={"weights": clean, "previous": previous})
        if deployment.always_warm:
            transaction.on_commit(partial(_warm, adapter.pk, True))
    return deployment


def deployment_set_always_warm(*, adapter: Adapter, enabled: bool, actor: AbstractBaseUser | None) -> Deployment:
    """Keep the adapter's deployed versions pinned on every worker (plan-gated), or stop."""
    with transaction.atomic():
        Tenant.objects.select_for_update().filter(pk=adapter.tenant_id).first()  # serialise the count
        deployment = Deployment.objects.select_for_update().get_or_create(adapter=adapter)[0]
        if enabled and not deployment.always_warm:
            allowed = plan_for(adapter.tenant.plan).always_warm_adapters
            used = Deployment.objects.filter(adapter__tenant_id=adapter.tenant_id, always_warm=True).count()
            if used >= allowed:
                raise limits.LimitExceeded(
                    "always_warm",
                    f"the {adapter.tenant.plan} plan allows {allowed} always-warm adapter{'s' * (allowed != 1)} "
                    f"and {adapter.tenant.slug} has {used}; turn one off or upgrade the plan",
                )
        if deployment.always_warm == enabled:
            return deployment
        deployment.always_warm = enabled
        deployment.updated_by = _actor(actor)
        deployment.save()
        _audit(adapter=adapter, actor=actor, action="deployment.always_warm_set", details={"always_warm": enabled})
        transaction.on_commit(partial(_warm, adapter.pk, enabled))
    return deployment


def _warm(adapter_id: int, enabled: bool) -> None:
    """After commit: stage the deployed versions (the stage task pins them when always-warm) and
    unpin the adapter's other versions; disabled: unpin them all."""
    adapter = Adapter.objects.select_related("tenant").filter(pk=adapter_id).first()
    if adapter is None:
        return
    deployed = deployed_versions(adapter=adapter) if enabled else []
    for version in deployed:
        staging.version_stage_enqueue(version=version)
    keep = {v.pk for v in deployed}
    others = [v for v in adapter.versions.filter(status=AdapterVersion.Status.READY) if v.pk not in keep]
    for url in staging.stage_targets():
        for version in others:
            staging.worker_pin(worker_url=url, lora_name=version.worker_name, pinned=False)


def deployment_set_evaluation_gate(*, adapter: Adapter, require: bool, min_pass_rate: float | None,
                                   actor: AbstractBaseUser | None) -> Deployment:
    """Require (or stop requiring) a passing evaluation before a version gets traffic;
    min_pass_rate 0..1, or None for "at least the serving version's pass rate". Audited."""
    if min_pass_rate is not None and (isinstance(min_pass_rate, bool) or not 0.0 <= float(min_pass_rate) <= 1.0):
        raise InvalidInput("evaluation_min_pass_rate", f"a pass rate is between 0 and 1, got {min_pass_rate!r}")
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get_or_create(adapter=adapter)[0]
        rate = None if min_pass_rate is None else float(min_pass_rate)
        if deployment.require_evaluation == require and deployment.evaluation_min_pass_rate == rate:
            return deployment
        deployment.require_evaluation, deployment.evaluation_min_pass_rate = require, rate
        deployment.updated_by = _actor(actor)
        deployment.save()
        _audit(adapter=adapter, actor=actor, action="deployment.evaluation_gate_set",
               details={"require_evaluation": require, "evaluation_min_pass_rate": rate})
    return deployment


def deployment_get(*, adapter: Adapter) -> Deployment:
    """The adapter's deployment (every adapter has one; made here for rows that predate that)."""
    return Deployment.objects.get_or_create(adapter=adapter)[0]


def deployment_update(*, adapter: Adapter, actor: AbstractBaseUser | None, weights: dict[int, int] | None = None,
                      always_warm: bool | None = None, require_evaluation: bool | None = None,
                      evaluation_min_pass_rate: float | None | object = ...) -> Deployment:
    """Set the weights, always-warm and/or the evaluation gate (what the REST API's PUT takes) in
    one transaction: all change or none does. The gate is set first, so weights sent with it are
    judged by it. evaluation_min_pass_rate: ... (not given) keeps it, None clears it."""
    with transaction.atomic():
        if require_evaluation is not None or evaluation_min_pass_rate is not ...:
            current = deployment_get(adapter=adapter)
            deployment_set_evaluation_gate(
                adapter=adapter, actor=actor,
                require=current.require_evaluation if require_evaluation is None else require_evaluation,
                min_pass_rate=current.evaluation_min_pass_rate if evaluation_min_pass_rate is ... else evaluation_min_pass_rate,
            )
        if weights is not None:
            deployment_set_weights(adapter=adapter, weights=weights, actor=actor)
        if always_warm is not None:
            deployment_set_always_warm(adapter=adapter, enabled=always_warm, actor=actor)
    return deployment_get(adapter=adapter)
