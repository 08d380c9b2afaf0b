// tests/deploy/validate_k8s.mjs OBJECTS.json NODE_MODULES_DIR — validates rendered Kubernetes objects against the
// OpenAPI schemas compiled into kubernetes-models (core API), @kubernetes-models/keda (ScaledObject)
// and @kubernetes-models/prometheus-operator (PodMonitor): types, formats, enums and required
// fields. Prints one line per object ("ok KIND NAME" / "FAIL KIND NAME: errors"); exit 1 when any
// object fails or has a kind we have no schema for.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const objects = JSON.parse(readFileSync(process.argv[2], "utf8"));
const modules = process.argv[3]; // where npm_install.sh put the packages
let failed = 0;

// apiVersion "apps/v1" → "kubernetes-models/apps/v1/Deployment.js"; "v1" → ".../v1/Service.js"
function modulePath(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  if (group === "keda.sh") return `@kubernetes-models/keda/keda.sh/${version}/${kind}.js`;
  if (group === "monitoring.coreos.com")
    return `@kubernetes-models/prometheus-operator/monitoring.coreos.com/${version}/${kind}.js`;
  return `kubernetes-models/${group ? group + "/" : ""}${version}/${kind}.js`;
}

for (const obj of objects) {
  const what = `${obj.kind} ${obj.metadata?.name}`;
  let Model;
  try {
    const url = pathToFileURL(join(modules, "node_modules", modulePath(obj.apiVersion, obj.kind)));
    Model = (await import(url.href))[obj.kind];
  } catch (e) {
    console.log(`FAIL ${what}: no schema for ${obj.apiVersion} ${obj.kind}`);
    failed++;
    continue;
  }
  try {
    new Model(obj).validate();
    console.log(`ok   ${what}`);
  } catch (e) {
    console.log(`FAIL ${what}: ${e.message}`);
    failed++;
  }
}
process.exit(failed ? 1 : 0);
