#!/usr/bin/env bash
# Creates the secret files compose.yaml reads (once, before the first `docker compose up`):
# the cluster secret and the Redis passwords, 256 random bits each, readable by the owner only.
# An existing file is kept, so running it again changes nothing.
# Usage: deploy/make-secrets.sh [DIR]   (default: $NORI_SECRETS_DIR, else ./secrets)
set -euo pipefail
dir="${1:-${NORI_SECRETS_DIR:-./secrets}}"
mkdir -p "$dir"
umask 077
for name in cluster_secret redis_password redis_gateway_password redis_prefill_password \
  redis_decode_password redis_batch_password; do
  [ -s "$dir/$name" ] || python3 -c 'import secrets; print(secrets.token_urlsafe(32))' >"$dir/$name"
done
echo "secrets in $dir"
