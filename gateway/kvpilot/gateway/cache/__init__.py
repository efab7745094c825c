"""The exact-match response cache: which requests it may answer (`rules`, pure), where answers
live (`store`: memory or Redis), the policy the proxy runs (`policy`), its config."""
