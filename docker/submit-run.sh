#!/bin/sh
# Register every site's SuperNode public key with the SuperLink, then submit the fedpose run.
# Used by the `coordinator` service of docker/compose.yaml; the same commands work by hand.
set -eu
SUPERLINK_CONTROL="${SUPERLINK_CONTROL:-superlink:9093}"
CA_CERT="${CA_CERT:-/certs/ca.crt}"
COORDINATOR_CONFIG="${COORDINATOR_CONFIG:-/app/configs/coordinator.toml}"
RESUME="${RESUME:-false}"
mkdir -p "$FLWR_HOME"
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "deployment"

[superlink.deployment]
address = "$SUPERLINK_CONTROL"
root-certificates = "$CA_CERT"
TOML
for pub in /certs/sites/*.pub; do
  site="$(basename "$pub" .pub)"
  flwr supernode list deployment --format json | grep -q "\"$site\"" \
    || flwr supernode register "$pub" deployment --name "$site"
done
flwr run /app deployment --run-config "coordinator-config=\"$COORDINATOR_CONFIG\" resume=$RESUME" --stream
