"""GangService's policy RPCs (docs/security.md): GetPolicy reads the policy
record afresh, SetPolicy replaces it (admin only, compare on its revision).
"""

from __future__ import annotations

import json
import logging

import grpc

from coordinator.core import authz
from coordinator.policy_store import PolicyRecord
from coordinator.service_base import ServicerBase, handled
from phalanx.errors import InvalidArgument
from phalanx.v1 import gang_pb2 as gpb

log = logging.getLogger(__name__)

def _policy_pb(record: PolicyRecord) -> gpb.PolicyRecord:
    return gpb.PolicyRecord(policy_json=json.dumps(record.policy.to_data(), sort_keys=True), revision=record.revision,
                            set_by=record.set_by, set_at=record.set_at)


class PolicyRpcs(ServicerBase):
    """The policy RPCs of GangServicer."""

    @handled
    async def GetPolicy(self, request: gpb.GetPolicyRequest, context: grpc.aio.ServicerContext) -> gpb.PolicyRecord:
        await self._authorize(context, authz.GET_POLICY)
        # A fresh read, not the cached copy: an admin bases SetPolicy's
        # expected_revision on it.
        return _policy_pb(await self.c.policies.read())

    @handled
    async def SetPolicy(self, request: gpb.SetPolicyRequest, context: grpc.aio.ServicerContext) -> gpb.PolicyRecord:
        caller = await self._authorize(context, authz.SET_POLICY)  # before the policy is even parsed
        try:
            policy = authz.parse_policy_json(request.policy_json)
        except authz.PolicyError as exc:
            raise InvalidArgument(str(exc)) from None
        record = await self.c.policies.set(policy, expected_revision=request.expected_revision,
                                           set_by=caller.owner or "(plaintext)", now=self.c.wall())
        log.info("policy record %s set to revision %d by %s", self.keys.policy(), record.revision, record.set_by)
        return _policy_pb(record)
