"""`sandpool egress`: the installation's egress proxy (HTTP CONNECT and plain HTTP), see docs/egress.md.

Sandboxed code reaches the network only through this proxy. Each connection
carries the sandbox's credential (in its proxy URL); the proxy looks up the
session it is bound to in Redis, admits the destination only when the session's
allow-list and the operator's ceiling both name it, resolves the name itself,
refuses internal addresses whatever the name resolves to, checks the TLS SNI of
a tunnel against its CONNECT authority, and meters the bytes per workspace.

Modules, one job each: `settings`, `hosts` (names and authorities), `allowlist`,
`addresses` (the address policy), `resolver`, `tls` (SNI of a ClientHello),
`http` (request heads and the proxy's own answers), `relay`, `metering`,
`identity` (the credential and its binding), `probes`, `metrics`, `server` (one
connection, start to end), `serving` (the process).
"""
