#!/usr/bin/env bash
# The network cluster/gcp.yaml's nodes live in, with the only firewall rules it has. Run it once per
# project before `ray up cluster/gcp.yaml`: Ray's cluster launcher creates no firewall rules on GCP (and
# without networkInterfaces in node_config it would put the nodes in the project's first subnet,
# typically the `default` network, whose default-allow-* rules admit SSH and more from anywhere).
#
#   cluster/gcp-network.sh YOUR-PROJECT-ID 203.0.113.10/32     # your IP, /32: the only SSH source
#
# A custom-mode VPC starts with the implied rules only: all egress allowed (pip, the bucket), all
# ingress denied. The two rules below admit the nodes to each other (Ray's ports: GCS 6379, the
# dashboard/job API 8265, Ray client 10001, raylets, object managers, workers) and SSH (22) from
# your address. Nothing else is reachable: the dashboard and MLflow are reached through
# `ray dashboard` / `ray attach -p 5000` (SSH tunnels). tests/test_cluster.py checks that this file and
# gcp.yaml agree (network, subnet, region, tag) and that no rule opens a private port to the world.
set -euo pipefail
PROJECT=${1:?usage: $0 PROJECT_ID YOUR_IP/32}
SSH_FROM=${2:?usage: $0 PROJECT_ID YOUR_IP/32}
# Every source range must be a CIDR; a public one at most a /24 (IPv4) or a /48 (IPv6), a private one
# (RFC 1918, fc00::/7) inside its block: `0.0.0.0/1,128.0.0.0/1` is the world too, and is refused.
command -v python3 >/dev/null || { echo "error: python3 is needed to check the SSH source ranges" >&2; exit 2; }
python3 - "$SSH_FROM" <<'CHECK' || exit 2
import ipaddress, sys
given = sys.argv[1]
for text in given.split(","):
    try:
        net = ipaddress.ip_network(text.strip(), strict=True)
    except ValueError as e:
        sys.exit(f"error: SSH source range {text!r}: not a CIDR ({e}); give your address /32")
    private = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")]
    widest = 24 if net.version == 4 else 48
    if not any(net.version == p.version and net.subnet_of(p) for p in private) and net.prefixlen < widest:
        sys.exit(f"error: SSH source range {text} is too wide ({net.num_addresses} addresses; a public range "
                 f"may be at most a /{widest}): refusing SSH from that much of the internet; give your address /32")
CHECK

NETWORK=lengthgen-ray
SUBNET=lengthgen-ray-us-central1
REGION=us-central1
RANGE=10.42.0.0/20
TAG=lengthgen-ray

gcloud compute networks create "$NETWORK" --project "$PROJECT" --subnet-mode custom
gcloud compute networks subnets create "$SUBNET" --project "$PROJECT" --network "$NETWORK" \
  --region "$REGION" --range "$RANGE" --enable-private-ip-google-access
gcloud compute firewall-rules create lengthgen-ray-internal --project "$PROJECT" --network "$NETWORK" \
  --direction INGRESS --allow tcp,udp,icmp --source-tags "$TAG" --target-tags "$TAG"
gcloud compute firewall-rules create lengthgen-ray-ssh --project "$PROJECT" --network "$NETWORK" \
  --direction INGRESS --allow tcp:22 --source-ranges "$SSH_FROM" --target-tags "$TAG"
