"""The wire: `bootstrap.proto` (registry, heartbeats, room rendezvous) and `node.proto` (Generate,
Prefill, Abort, Load, CheckIntegrity), with their generated stubs (`make proto` regenerates)."""
